"""ModelRunner: the model, its KV cache and one `execute` per scheduler step (prefill chunks and decodes mixed).

The runner owns tensors only; which sequence sits in which slot and which blocks it owns is decided by the
pure-Python scheduler/block manager (engine/scheduler.py, engine/kv_cache.py). Everything it needs to know comes
from the `EngineConfig` it is built with (engine/config.py); it reads no environment flag.
"""

from __future__ import annotations

import time
from collections.abc import Sequence as Seq
from typing import Any, Protocol

import torch

from engine.backends import Backend
from engine.config import EngineConfig, GraphMode
from engine.envs import get_envs
from engine.host_memory import place_weights
from engine.model import drafting
from engine.model.cache import DraftInput, KVCache, SeqStep, StepPlan
from engine.model.dspark_proposer import write_context
from engine.model.model import Transformer
from engine.model.mtp_proposer import mtp_fill_ring
from engine.model.numerics import index_key_format
from engine.parallel import Parallel
from engine.profiling import RegionTimer
from engine.regions import RegionRunner
from engine.speculative import DraftRequest
from nki_kernels.dispatch import Dispatcher

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    try:
        return DTYPES[str(name)]
    except KeyError:
        raise ValueError(f"dtype {name!r} is not one of float32, bfloat16") from None


class SequenceLike(Protocol):
    slot: int | None
    block_table: list[int]
    num_computed_tokens: int

    def step_token_ids(self, start: int, n: int) -> list[int]: ...


class ModelRunner:
    def __init__(self, config: EngineConfig, model: Transformer, par: Parallel | None, backend: Backend,
                 dispatcher: Dispatcher | None = None) -> None:
        """`dispatcher`: the kernel-launch state of this runner (executor, LNC, counters), active during every
        forward (nki_kernels/dispatch.py)."""
        cfg, cache, graph = config.model.config, config.cache, config.graph
        self.config, self.cfg, self.model = config, cfg, model
        self.par = par or Parallel()
        self.backend = backend
        self.dispatcher = dispatcher or Dispatcher()
        self.dtype = parse_dtype(config.model.dtype)
        self.max_num_seqs, self.num_kv_blocks = cache.max_num_seqs, cache.num_kv_blocks
        self.block_size, self.max_model_len = cache.block_size, cache.max_model_len
        self.vocab_size = cfg.vocab_size
        self.batch_decode = graph.batch_decode
        self.graph_mode = graph.mode
        self.chunk_graphs = bool(graph.chunk_graphs)  # multi-token entries as chunk-region graphs (else eager)
        layer_ids = list(range(cfg.n_layers)) + [cfg.n_layers + i for i in range(len(model.mtp))]
        self.num_steps = 0  # forward calls so far
        for layer in [*model.layers, *model.mtp]:
            layer.ffn.capacity = graph.moe_capacity
            layer.ffn.static_moe = str(graph.moe)
            layer.ffn.stack_experts()  # views: no extra memory; lets decode regions gather experts by index
        kops = model.ops.kernel_ops  # a kernel table: its weight layouts made now, not in a graph
        self.kernel_layouts: dict[str, int] = {}
        if kops is not None:
            from engine.model.kernel_weights import prepare

            with self.backend.grad_context():
                self.kernel_layouts = dict(prepare(model, kops, self.dtype))
        # host weights on huge pages, now that they are final and before any kernel has taken an address
        self.weights_memory = place_weights(model, get_envs().DEEPINFER_HOST_HUGE_PAGES) \
            if torch.device(self.backend.device).type == "cpu" else None
        self.timer = RegionTimer(enabled=graph.region_timing, synchronize=self.backend.synchronize)
        self.device = self.backend.device
        self.cache = KVCache(cfg, cache.max_num_seqs, cache.num_kv_blocks, cache.block_size, self.dtype, layer_ids,
                             cp=self.par.cp, device=self.device, scratch=graph.mode is not GraphMode.EAGER,
                             spare=config.spare_positions, kv_dtype=str(cache.kv_cache_dtype),
                             index_keys=index_key_format(config.model.numerics),
                             snapshots=config.scheduler_cache.prefix_snapshots)
        self._behind: dict[int, int] = {}  # MTP slots whose catch-up was put off (`_resume`)
        # how the speculation policy (engine/speculative.py SpecPolicy) times this runner's steps: the process's CPU
        # time where torch runs one thread (the kernels then run in this thread, so other processes on a shared
        # machine do not bill their time to a step), else wall time
        self.cost_clock = time.process_time if torch.get_num_threads() == 1 else time.perf_counter
        self.free_slot(0)  # a fresh slot already; on a graph backend this compiles the slot reset up front
        # prefix caching: eager prefill chunks save the slot state at the block boundaries they pass (engine/model/
        # cache.py `tap_ring`); not chunk graphs, nor with a draft layer (its ring is written by the draft pass)
        self.chunk_taps = bool(self.cache.snap_roots) and not self.chunk_graphs and not config.spec.enabled
        self.keep_hidden = config.spec.enabled
        # a verify step's rows (the last token + its drafts) run as decode rows (StepPlan.build): eager, one rank
        self.decode_rows = self.cache.spare + 1 if graph.mode is GraphMode.EAGER and self.par.cp == 1 else 1
        self.proposer = drafting.proposer_for(config.spec.method)
        self.capture = self.proposer is not None and self.proposer.captures  # its context, taken by the target step
        self._last: tuple[list[SeqStep], torch.Tensor, Any] | None = None  # (steps, final streams, capture)
        # Speculation off for a step (SpecPolicy): the draft head's catch-up is put off and what it would read of
        # those positions kept per slot, position p at row p % rows - MTP: the target's final streams and the next
        # ids; DSpark: the captured context input - `_behind[slot]` = the first position not caught up. The next
        # drafting call writes the draft ring's rows of the last window of them first.
        self.defers_catch_up = self.proposer is not None and self.par.cp == 1 and graph.mode is GraphMode.EAGER
        if self.defers_catch_up:
            rows = self.cache.layers[cfg.n_layers].win_kv.shape[1]  # the draft ring's: window + spare
            width = (len(cfg.dspark_target_layer_ids) * cfg.dim,) if self.capture else (cfg.hc_mult, cfg.dim)
            self._held = torch.zeros(cache.max_num_seqs, rows, *width, dtype=self.dtype, device=self.device)
            self._held_ids = torch.zeros(cache.max_num_seqs, rows, dtype=torch.long, device=self.device)
            self._pending: list[tuple[Any, list[int], list[int]]] = []  # (a step's rows, flat ring row, id)
            self._flush_every = 16  # steps: what the pending rows hold stays small (a slot kept twice: the later)
        # DSpark: a decode step's context rows are averaged into `_held` inside the target layers' own native
        # attention calls where the op table has them (the host table's attn_decode `hold`), not by a call of their
        # own after the step (with its checks and arguments, a visible share of a small model's step); `hold` then
        # only marks the slots behind. The native mean is torch's bits while hc_mult <= 4 or dim % 64 == 0 (as for
        # keep_rows); elsewhere, or where a layer runs op by op, `hold` keeps the rows by its call as before.
        self._hold_in_layers: tuple[dict[int, int], int, int] | None = None  # StepPlan.hold
        self._held_by_step = False  # whether the last forward's layers held every row of it
        if self.defers_catch_up and self.capture and self._held.dtype is torch.float32 and self._held.is_cpu \
                and (cfg.hc_mult <= 4 or cfg.dim % 64 == 0):
            at, size = self._held.data_ptr(), self._held.element_size()
            self._hold_in_layers = ({lid: at + j * cfg.dim * size for j, lid in enumerate(cfg.dspark_target_layer_ids)},
                                    self._held.shape[1], self._held.shape[2])
        self.regions: RegionRunner | None = None
        if graph.mode is not GraphMode.EAGER:
            self.regions = RegionRunner(model, self.cache, graph.mode, self.backend,
                                        max_blocks=cache.max_blocks_per_seq, timer=self.timer,
                                        buckets=graph.batch_buckets,
                                        chunk_buckets=graph.chunk_sizes(cache.max_num_batched_tokens),
                                        min_blocks=graph.min_blocks(cache.block_size))

    # -- execution -------------------------------------------------------------------------------------------------
    def free_slot(self, slot: int) -> None:
        self._behind.pop(slot, None)
        with self.backend.grad_context():
            self.cache.reset_slot(slot)
            self.backend.step_end()  # a graph of its own: the next step's graph does not depend on which slots freed

    def save_prefix_state(self, slot: int, snap: int) -> None:
        """Prefix caching: copy slot `slot`'s state into snapshot `snap` (engine/kv_cache.py)."""
        with self.backend.grad_context():
            self.cache.save_state(slot, snap)
            self.backend.step_end()

    def restore_prefix_state(self, slot: int, snap: int) -> None:
        """Prefix caching: slot `slot`'s state from snapshot `snap` (a cached prefix's, before its suffix runs)."""
        self._behind.pop(slot, None)
        with self.backend.grad_context():
            self.cache.restore_state(slot, snap)
            self.backend.step_end()

    def forward(self, steps: list[SeqStep], input_ids: torch.Tensor, logit_index: torch.Tensor | None = None,
                return_hidden: bool = False) -> torch.Tensor:
        """Run one step. `steps` carry each sequence's slot, start position, token count and block table;
        `input_ids` [T] holds their tokens back to back. Returns fp32 logits of `logit_index` tokens (default: the
        last token of each step) [len, vocab] on the host, or the final streams [T, n, dim] (on the device) with
        `return_hidden`."""
        with self.backend.grad_context(), self.dispatcher.active():
            return self._forward(steps, input_ids, logit_index, return_hidden)

    def _forward(self, steps: list[SeqStep], input_ids: torch.Tensor, logit_index: torch.Tensor | None,
                 return_hidden: bool) -> torch.Tensor:
        for s in steps:
            if s.start + s.n > self.max_model_len:
                raise ValueError(f"sequence needs {s.start + s.n} positions, max_model_len is {self.max_model_len}")
            need = -(-(s.start + s.n) // self.block_size)
            if len(s.block_table) < need:
                raise ValueError(f"slot {s.slot}: block table has {len(s.block_table)} blocks, needs {need}")
        self.num_steps += 1
        captured = None
        graphs = self.regions is not None and self.batch_decode and bool(steps) and not self.capture
        multi = any(s.n > 1 for s in steps)
        if graphs and multi and self.chunk_graphs:
            # multi-token entries (prefill chunks, verify steps): decode run + chunk-region runs, heads per run
            rows = [s.token_start + s.n - 1 for s in steps] if logit_index is None else logit_index.tolist()
            res = self.regions.step(steps, input_ids, [] if return_hidden else rows,
                                    hidden=return_hidden or self.keep_hidden)
            if self.keep_hidden:
                self._last = (steps, res.hidden, None)
            return res.hidden if return_hidden else res.logits
        if graphs and not multi:
            # pure decode: region graphs; rows in step order, then the bucket's padding rows
            x = self.regions.decode_step(steps, input_ids, padded=not return_hidden)
            last = None
        else:
            plan = StepPlan.build(steps, self.block_size, batch_decode=self.batch_decode, device=self.device,
                                  decode_rows=self.decode_rows)
            if self.capture:
                if not multi and not self._pending:  # (pending rows are older: the flush would write over these)
                    plan.hold = self._hold_in_layers
                x, captured = self.proposer.hidden_and_capture(self.model, input_ids.to(self.device), plan, self.cache)
                self._held_by_step = plan.hold is not None and plan.held == len(plan.hold[0])
            else:
                x = self.model.hidden(input_ids.to(self.device), plan, self.cache, self.timer)
            last = [s.token_start + s.n - 1 for s in steps]
        if self.keep_hidden:  # the draft head reads the target's final streams of this step (`draft`)
            t = int(input_ids.shape[0])
            if captured is not None and len(captured) != t:
                captured = captured.rows(slice(0, t))
            self._last = (steps, x[:t], captured)
        if return_hidden:
            return x
        with self.timer.region("head"):
            if last is None:  # the head graph over the whole bucket (one graph per bucket); rows cut on the host
                logits = self.regions.head(x)
                self.backend.step_end()
                logits = self.backend.to_host(logits)
                return logits[: len(steps)] if logit_index is None else logits[logit_index]
            if logit_index is not None:
                x = x[logit_index.to(self.device)]
            elif last is not None and last != list(range(x.shape[0])):
                x = x[torch.tensor(last, device=self.device)]
            logits = self.model.logits(x)
            self.backend.step_end()
            return self.backend.to_host(logits)

    def execute(self, batch: Seq[tuple[SequenceLike, int]], full_logits: Seq[int] = ()) -> torch.Tensor:
        """Scheduler entry point: for each (seq, n), process seq.all_token_ids[num_computed : num_computed + n] at
        those positions in seq.slot with seq.block_table. Returns fp32 logits [len(batch), vocab] of each entry's
        last processed token; the entries whose indices are in `full_logits` (prompt logprobs) get all n rows of
        their chunk instead, in place. Does not advance num_computed_tokens."""
        steps, ids = _describe(batch)
        return self.forward(_to_steps(steps), torch.tensor(ids, dtype=torch.long), _logit_index(steps, full_logits))


    def draft(self, requests: Seq[DraftRequest]) -> list[list[int]]:
        """The draft head after a step (engine/llm.py): catch up over each request's final positions with the
        target's streams there (kept by the last forward) and propose `want` drafts; the drafted ids per request."""
        if self._last is None:
            raise RuntimeError("draft() before any forward of this runner")
        steps, hidden, capture = self._last
        requests = list(requests)
        if self.defers_catch_up and all(r.defer for r in requests):  # only held: no draft head runs
            with self.backend.grad_context():
                self._resume(steps, hidden if capture is None else capture, requests)
            return [[] for _ in requests]
        with self.backend.grad_context(), self.dispatcher.active():
            captured = None if capture is None else capture.tensor()  # the context made, where a draft head runs
            if not self.defers_catch_up or not (self._behind or self._pending or any(r.defer for r in requests)):
                # nothing held or to hold (`_resume` would pass every request on as it is)
                return drafting.draft_for_requests(self.model, self.cache, self.config, steps, hidden, captured,
                                                   requests)
            live = self._resume(steps, hidden if capture is None else capture, requests)
            out: list[list[int]] = [[] for _ in requests]
            drafted = drafting.draft_for_requests(self.model, self.cache, self.config, steps, hidden, captured,
                                                  [r for _, r in live])
            for (i, _), toks in zip(live, drafted, strict=True):
                out[i] = toks
            return out

    def _resume(self, steps: list[SeqStep], hidden: Any, requests: list[DraftRequest],
                ) -> list[tuple[int, DraftRequest]]:
        """Keep the deferred requests' rows of `hidden` (MTP: final streams; DSpark: its `Capture`) in
        `_held` and drop them (their slots fall behind); for a request whose slot is behind, write the draft
        ring's rows of the held positions it needs - the last window before its end, which is all a later draft
        query reads - as its catch-up would have. Returns (index, request) of the requests to run."""
        rows, win, dev = self._held.shape[1], self.cfg.window_size, self._held.device
        live = []
        keep: tuple[list[int], list[int], list[int]] = ([], [], [])  # flat held row, step row, id
        gap: tuple[list[int], list[int]] = ([], [])  # slot, position
        spans: list[DraftInput] = []  # DSpark: the same positions per request
        for i, r in enumerate(requests):
            if r.defer:
                first = max(0, r.n - rows)
                keep[0].extend(r.slot * rows + (r.start + j) % rows for j in range(first, r.n))
                keep[1].extend(range(steps[r.entry].token_start + first, steps[r.entry].token_start + r.n))
                keep[2].extend(r.next_ids[first:])
                self._behind.setdefault(r.slot, r.start)
                continue
            live.append((i, r))
            behind = self._behind.pop(r.slot, None)
            if behind is not None:  # the held positions of the window before this request's end
                first = max(behind, min(r.start, r.start + r.n - win))
                gap[0].extend([r.slot] * (r.start - first))
                gap[1].extend(range(first, r.start))
                if r.start > first:
                    spans.append(DraftInput(r.slot, first, r.start - first, torch.empty(0, dtype=torch.long)))
        if keep[0] and not self._held_by_step:
            self._keep(hidden, *keep)
        if self._pending and (gap[0] or len(self._pending) >= self._flush_every):
            self._flush()
        if gap[0]:  # their draft ring rows, for all resumed slots at once
            slots, pos = torch.tensor(gap[0], device=dev), torch.tensor(gap[1], device=dev)
            if self.capture:
                write_context(self.model, self.cache, spans, self._held[slots, pos % rows])
            else:
                mtp_fill_ring(self.model, self.cache, slots, pos, self._held[slots, pos % rows],
                              self._held_ids[slots, pos % rows])
        return live

    def hold(self, decodes: list[tuple[int, int, int, int]]) -> None:
        """Speculation off for the next step and every entry of this one a one-token decode that defers: keep the
        final streams of each (entry, slot, position, next id) for a later resume, as `draft` does for requests
        that all defer (`_resume`), without a request each; where the step's layers held them already
        (`_held_by_step`), only mark the slots behind. The step's streams are let go then (nothing else reads them):
        freed before the next step allocates its own, as a plain engine's are."""
        behind = self._behind
        for _, slot, pos, _ in decodes:
            behind.setdefault(slot, pos)
        if not self._held_by_step:
            steps, hidden, captured = self._last
            rows = self._held.shape[1]
            at = [slot * rows + pos % rows for _, slot, pos, _ in decodes]
            self._keep(hidden if captured is None else captured, at, [steps[e].token_start for e, *_ in decodes],
                       [nid for *_, nid in decodes])
            if len(self._pending) >= self._flush_every:
                with self.backend.grad_context():
                    self._flush()
        self._last = None

    def _keep(self, src: Any, at: list[int], step_rows: list[int], ids: list[int]) -> None:
        """Rows `step_rows` of `src` (a step's final streams, or its DSpark `Capture`) kept for the flat held rows
        `at` (slot * rows + ring row): written into `_held` at once by the op table's `keep_rows` (one native call)
        where it has one, else kept - all of a step's rows (a decode step) by reference: a step's streams are new
        tensors nothing writes later; some of them copied, not to keep a long step alive - and written in one go
        when a slot resumes, or every few steps (`_flush`; while rows wait there, later ones wait too: the later of
        a row kept twice wins)."""
        write = self.model.ops.keep_rows
        if write is not None and not self._pending:
            streams, mean = (src.streams, True) if hasattr(src, "streams") else ([src], False)  # a Capture: averaged
            if write(streams, step_rows, at, ids, mean, self._held, self._held_ids):
                return
        n = len(step_rows)
        if n == len(src) and step_rows == list(range(n)):
            held = src
        else:
            index = torch.tensor(step_rows, device=self._held.device)
            held = src.index_select(0, index) if isinstance(src, torch.Tensor) else src.rows(index)
        self._pending.append((held, at, ids))

    def _flush(self) -> None:
        """Write the pending held rows into `_held` / `_held_ids`; where a row was kept twice (a slot's later
        sequence) the later wins."""
        dev = self._held.device
        parts = [p[0] for p in self._pending]
        held = torch.cat(parts) if isinstance(parts[0], torch.Tensor) else type(parts[0]).cat(parts).tensor()
        at = [x for p in self._pending for x in p[1]]
        ids = [x for p in self._pending for x in p[2]]
        self._pending.clear()
        last = {a: i for i, a in enumerate(at)}
        if len(last) < len(at):
            pick = sorted(last.values())
            held, at, ids = held[torch.tensor(pick, device=dev)], [at[i] for i in pick], [ids[i] for i in pick]
        where = torch.tensor(at, device=dev)
        self._held.view(-1, *self._held.shape[2:]).index_copy_(0, where, held.to(self._held.dtype))
        self._held_ids.view(-1).index_copy_(0, where, torch.tensor(ids, device=dev))


class DistributedRunner:
    """Rank 0's face of a context-parallel runner: the scheduler on rank 0 calls `execute` / `free_slot` (or a
    benchmark calls `forward`) as on a local runner; each call is broadcast to the other ranks (running
    `worker_loop`) and executed everywhere, since every rank holds its share of the KV state. All ranks compute the
    same logits; rank 0's are returned. Everything else (`par`, `cache`, `regions`, `timer`, ...) is rank 0's."""

    def __init__(self, runner: ModelRunner) -> None:
        import torch.distributed as dist

        self._dist, self.runner = dist, runner

    def __getattr__(self, name: str):  # rank 0's runner attributes (config, sizes, timer, regions, par, ...)
        if name == "runner":  # not set yet (e.g. during unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.runner, name)

    def _send(self, msg: tuple) -> None:
        box = [msg]
        self._dist.broadcast_object_list(box, src=0, group=self.runner.par.control_group)

    def forward(self, steps: list[SeqStep], input_ids: torch.Tensor) -> torch.Tensor:
        desc = [(s.slot, s.start, s.n, s.token_start, s.block_table.tolist()) for s in steps]
        self._send(("forward", desc, input_ids.tolist()))
        return self.runner.forward(steps, input_ids)

    def execute(self, batch: Seq[tuple[SequenceLike, int]], full_logits: Seq[int] = ()) -> torch.Tensor:
        steps, ids = _describe(batch)
        self._send(("forward", steps, ids))  # the other ranks' logits are not used: the head has no collective
        return self.runner.forward(_to_steps(steps), torch.tensor(ids, dtype=torch.long),
                                   _logit_index(steps, full_logits))

    def free_slot(self, slot: int) -> None:
        self._send(("free", slot))
        self.runner.free_slot(slot)

    def draft(self, requests: Seq[DraftRequest]) -> list[list[int]]:
        self._send(("draft", list(requests)))  # every rank runs the draft head: its attention is sharded too
        return self.runner.draft(requests)

    def shutdown(self) -> None:
        self._send(("stop",))


def _describe(batch: Seq[tuple[SequenceLike, int]]) -> tuple[list[tuple], list[int]]:
    """(slot, start, n, token offset, block table[, prefix-cache snapshot taps]) per entry, and the flat ids."""
    steps, ids, offset = [], [], 0
    for seq, n in batch:
        start = seq.num_computed_tokens
        ids.extend(seq.step_token_ids(start, n))
        taps = tuple(getattr(seq, "snap_taps", ()))
        steps.append((seq.slot, start, n, offset, list(seq.block_table), *((taps,) if taps else ())))
        offset += n
    return steps, ids


def _logit_index(desc: list[tuple[int, int, int, int, list[int]]], full: Seq[int]) -> torch.Tensor | None:
    """Token rows whose logits `execute` returns: each step's last token, or all its tokens for steps in `full`
    (None: the default, every step's last token)."""
    if not full:
        return None
    rows: list[int] = []
    for i, (_, _, n, off, *_) in enumerate(desc):
        rows.extend(range(off, off + n) if i in full else (off + n - 1,))
    return torch.tensor(rows, dtype=torch.long)


def _to_steps(desc: list[tuple]) -> list[SeqStep]:
    return [SeqStep(slot=d[0], start=d[1], n=d[2], token_start=d[3], block_table=torch.tensor(d[4], dtype=torch.long),
                    snaps=d[5] if len(d) > 5 else ()) for d in desc]


def worker_loop(runner: ModelRunner) -> None:
    """Ranks > 0: execute what rank 0's DistributedRunner broadcasts, until it says stop."""
    import torch.distributed as dist

    while True:
        box = [None]
        dist.broadcast_object_list(box, src=0, group=runner.par.control_group)
        msg = box[0]
        if msg[0] == "forward":
            runner.forward(_to_steps(msg[1]), torch.tensor(msg[2], dtype=torch.long))
        elif msg[0] == "free":
            runner.free_slot(msg[1])
        elif msg[0] == "draft":
            runner.draft(msg[1])
        elif msg[0] == "stop":
            return
        else:
            raise RuntimeError(f"unknown message from rank 0: {msg[0]!r}")
