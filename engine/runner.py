"""ModelRunner: the model, its KV cache and one `execute` per scheduler step (prefill chunks and decodes mixed).

The runner owns tensors only; which sequence sits in which slot and which blocks it owns is decided by the
pure-Python scheduler/block manager (engine/scheduler.py, engine/kv_cache.py).
"""

from __future__ import annotations

import math
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from engine.backends import get_backend
from engine.config import ModelConfig
from engine.envs import get_envs
from engine.model.cache import KVCache, SeqStep, StepPlan
from engine.model.model import Transformer
from engine.parallel import Parallel, check_layout
from engine.profiling import RegionTimer
from engine.regions import GRAPH_MODES, RegionRunner

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype {name!r} is not one of float32, bfloat16") from None


class SequenceLike(Protocol):
    slot: int | None
    block_table: list[int]
    num_computed_tokens: int

    @property
    def all_token_ids(self) -> list[int]: ...


def default_block_size(cfg: ModelConfig, cp: int = 1) -> int:
    """Smallest multiple of every compress ratio x cp that is at least 16 (128 x cp for the real models)."""
    size = 1
    for r in set(cfg.compress_ratios):
        if r:
            size = size * r // math.gcd(size, r)
    size *= cp
    return size * max(1, -(-16 // size))


@dataclass(frozen=True)
class RunnerConfig:
    max_num_seqs: int = 8
    num_kv_blocks: int = 256
    block_size: int | None = None  # None: default_block_size(cfg)
    max_model_len: int = 4096
    dtype: str = "float32"
    batch_decode: bool = True  # vectorised decode path (False: every sequence goes through the chunk path)
    with_mtp: bool = False  # load and keep the MTP block (mtp.*) and its cache; off unless asked (no lookahead yet)
    # Region graphs (engine/regions.py); None = take the DEEPINFER_* flag (engine/envs.py).
    graph_mode: str | None = None  # eager | regions | layer
    region_timing: bool | None = None
    moe_capacity: float | None = None  # capacity factor of the grouped expert path for prefill chunks
    host_compiler: str | None = None  # inductor | aot_eager | eager | none


class ModelRunner:
    def __init__(self, cfg: ModelConfig, model: Transformer, rc: RunnerConfig, par: Parallel | None = None) -> None:
        self.cfg, self.model, self.rc = cfg, model, rc
        self.par = par or Parallel()
        self.dtype = parse_dtype(rc.dtype)
        self.max_num_seqs, self.num_kv_blocks = rc.max_num_seqs, rc.num_kv_blocks
        self.block_size = rc.block_size or default_block_size(cfg, self.par.cp)
        self.max_model_len = min(rc.max_model_len, cfg.max_position_embeddings)
        layer_ids = list(range(cfg.n_layers)) + [cfg.n_layers + i for i in range(len(model.mtp))]
        self.num_steps = 0  # forward calls so far
        envs = get_envs()

        def pick(value: Any, flag: Any) -> Any:  # RunnerConfig field, else the DEEPINFER_* flag
            return flag if value is None else value

        self.graph_mode = pick(rc.graph_mode, envs.DEEPINFER_NEURON_GRAPH_MODE)
        if self.graph_mode not in GRAPH_MODES:
            raise ValueError(f"graph_mode {self.graph_mode!r}: expected one of {', '.join(GRAPH_MODES)}")
        self.timer = RegionTimer(enabled=bool(pick(rc.region_timing, envs.DEEPINFER_NEURON_REGION_TIMING)))
        for layer in [*model.layers, *model.mtp]:
            layer.ffn.capacity = float(pick(rc.moe_capacity, envs.DEEPINFER_NEURON_MOE_CAPACITY))
        self.cache = KVCache(cfg, rc.max_num_seqs, rc.num_kv_blocks, self.block_size, self.dtype, layer_ids,
                             cp=self.par.cp, scratch=self.graph_mode != "eager")
        self.regions: RegionRunner | None = None
        if self.graph_mode != "eager":
            backend = get_backend("neuron" if envs.DEEPINFER_BACKEND == "neuron" else "host",
                                  **({} if envs.DEEPINFER_BACKEND == "neuron" else
                                     {"compiler": pick(rc.host_compiler, envs.DEEPINFER_HOST_COMPILER)}))
            self.timer = RegionTimer(enabled=self.timer.enabled, synchronize=backend.synchronize)
            self.regions = RegionRunner(model, self.cache, self.graph_mode, backend,
                                        max_blocks=-(-self.max_model_len // self.block_size), timer=self.timer)

    # -- construction ----------------------------------------------------------------------------------------------
    @classmethod
    def from_state_dict(cls, cfg: ModelConfig, state: dict[str, torch.Tensor], rc: RunnerConfig,
                        par: Parallel | None = None) -> ModelRunner:
        """Build from official-named tensors; under expert parallelism only this rank's experts are kept."""
        par = par or Parallel()
        check_layout(cfg, par.cp)
        model = Transformer(cfg, par, with_mtp=rc.with_mtp)
        wanted = model.state_dict(keep_vars=True).keys()
        model.load_weights({k: v for k, v in state.items() if k in wanted}, parse_dtype(rc.dtype))
        return cls(cfg, model, rc, par)

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, rc: RunnerConfig, par: Parallel | None = None) -> ModelRunner:
        """Load from a checkpoint directory, reading only the tensors this rank needs (memory-mapped)."""
        from engine.loader import load_checkpoint

        par = par or Parallel()
        cfg = ModelConfig.from_json(Path(model_dir))
        check_layout(cfg, par.cp)
        experts = par.local_experts(cfg.n_routed_experts) if par.enabled else None
        state = load_checkpoint(model_dir, cfg, dtype=torch.float32, include_mtp=rc.with_mtp, experts=experts)
        return cls.from_state_dict(cfg, state, rc, par)

    # -- execution -------------------------------------------------------------------------------------------------
    def free_slot(self, slot: int) -> None:
        self.cache.reset_slot(slot)

    @torch.inference_mode()
    def forward(self, steps: list[SeqStep], input_ids: torch.Tensor, logit_index: torch.Tensor | None = None,
                return_hidden: bool = False) -> torch.Tensor:
        """Run one step. `steps` carry each sequence's slot, start position, token count and block table;
        `input_ids` [T] holds their tokens back to back. Returns fp32 logits of `logit_index` tokens (default: the
        last token of each step) [len, vocab], or the final streams [T, n, dim] with `return_hidden`."""
        for s in steps:
            if s.start + s.n > self.max_model_len:
                raise ValueError(f"sequence needs {s.start + s.n} positions, max_model_len is {self.max_model_len}")
            need = -(-(s.start + s.n) // self.block_size)
            if len(s.block_table) < need:
                raise ValueError(f"slot {s.slot}: block table has {len(s.block_table)} blocks, needs {need}")
        self.num_steps += 1
        if self.regions is not None and self.rc.batch_decode and steps and all(s.n == 1 for s in steps):
            x = self.regions.decode_step(steps, input_ids)  # pure decode: region graphs
        else:
            plan = StepPlan.build(steps, self.block_size, batch_decode=self.rc.batch_decode)
            x = self.model.hidden(input_ids, plan, self.cache, self.timer)
        if return_hidden:
            return x
        if logit_index is None:
            logit_index = torch.tensor([s.token_start + s.n - 1 for s in steps])
        with self.timer.region("head"):
            return self.model.logits(x[logit_index])

    def execute(self, batch: Seq[tuple[SequenceLike, int]]) -> torch.Tensor:
        """Scheduler entry point: for each (seq, n), process seq.all_token_ids[num_computed : num_computed + n] at
        those positions in seq.slot with seq.block_table. Returns fp32 logits [len(batch), vocab] of each entry's
        last processed token. Does not advance num_computed_tokens."""
        steps, ids = _describe(batch)
        return self.forward(_to_steps(steps), torch.tensor(ids, dtype=torch.long))


def build_runner(config: Any, par: Parallel | None = None) -> ModelRunner:
    """Build a runner from an engine config (duck-typed: model_dir, dtype, max_num_seqs, num_kv_blocks, block_size,
    max_model_len, load_format). `load_format="dummy"` takes random weights for the directory's config.json."""
    rc = RunnerConfig(
        max_num_seqs=config.max_num_seqs, num_kv_blocks=config.num_kv_blocks,
        block_size=getattr(config, "block_size", None), max_model_len=config.max_model_len,
        dtype=str(config.dtype))
    if getattr(config, "load_format", "safetensors") == "dummy":
        from engine.model.dummy import random_weights

        cfg = ModelConfig.from_json(Path(config.model_dir))
        return ModelRunner.from_state_dict(cfg, random_weights(cfg, seed=getattr(config, "seed", 0),
                                                               with_mtp=False), rc, par)
    return ModelRunner.from_model_dir(config.model_dir, rc, par)


@torch.inference_mode()
def greedy_generate(runner: ModelRunner, prompts: list[list[int]], max_new_tokens: int,
                    prefill_chunk: int | None = None) -> tuple[list[list[int]], list[torch.Tensor]]:
    """All prompts as one batch, without the scheduler: prefill (in one step, or in chunks of `prefill_chunk` tokens
    per sequence per step), then batched greedy decode. Returns per prompt the generated ids and the fp32 logits
    [max_new_tokens, vocab] each token was chosen from. Used by `deepinfer golden` and the engine tests."""
    if len(prompts) > runner.max_num_seqs:
        raise ValueError(f"{len(prompts)} prompts but the runner has {runner.max_num_seqs} slots")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("empty prompt")
    bs = runner.block_size
    tables, nxt = [], 0
    for p in prompts:
        need = -(-(len(p) + max_new_tokens) // bs)
        if nxt + need > runner.num_kv_blocks:
            raise ValueError(f"KV pool too small: {runner.num_kv_blocks} blocks of {bs} for this batch")
        tables.append(torch.arange(nxt, nxt + need))
        nxt += need
    for slot in range(len(prompts)):
        runner.free_slot(slot)
    seqs = [list(p) for p in prompts]
    done = [0] * len(prompts)  # tokens already in the cache
    outs: list[list[int]] = [[] for _ in prompts]
    logits: list[list[torch.Tensor]] = [[] for _ in prompts]
    while any(len(o) < max_new_tokens for o in outs):
        steps, ids, off = [], [], 0
        for i, s in enumerate(seqs):
            if len(outs[i]) >= max_new_tokens:
                continue
            n = len(s) - done[i]
            if prefill_chunk and n > 1:
                n = min(n, prefill_chunk)
            steps.append(SeqStep(slot=i, start=done[i], n=n, token_start=off, block_table=tables[i]))
            ids.extend(s[done[i]: done[i] + n])
            off += n
        lg = runner.forward(steps, torch.tensor(ids, dtype=torch.long))
        for step, row in zip(steps, lg, strict=True):
            i = step.slot
            done[i] += step.n
            if done[i] == len(seqs[i]):  # caught up: this step's last logits pick the next token
                tok = int(torch.argmax(row))
                outs[i].append(tok)
                logits[i].append(row)
                seqs[i].append(tok)
    return outs, [torch.stack(x) for x in logits]


class DistributedRunner:
    """Rank 0's face of a context-parallel runner: the scheduler on rank 0 calls `execute` / `free_slot` as on a
    local runner; each call is broadcast to the other ranks (running `worker_loop`) and executed everywhere, since
    every rank holds its share of the KV state. All ranks compute the same logits; rank 0's are returned."""

    def __init__(self, runner: ModelRunner) -> None:
        import torch.distributed as dist

        self._dist, self.runner = dist, runner
        self.max_num_seqs, self.num_kv_blocks = runner.max_num_seqs, runner.num_kv_blocks
        self.block_size, self.max_model_len = runner.block_size, runner.max_model_len
        self.cfg = runner.cfg

    def _send(self, msg: tuple) -> None:
        box = [msg]
        self._dist.broadcast_object_list(box, src=0, group=self.runner.par.control_group)

    def execute(self, batch: Seq[tuple[SequenceLike, int]]) -> torch.Tensor:
        steps, ids = _describe(batch)
        self._send(("forward", steps, ids))
        return self.runner.forward(_to_steps(steps), torch.tensor(ids, dtype=torch.long))

    def free_slot(self, slot: int) -> None:
        self._send(("free", slot))
        self.runner.free_slot(slot)

    def shutdown(self) -> None:
        self._send(("stop",))


def _describe(batch: Seq[tuple[SequenceLike, int]]) -> tuple[list[tuple[int, int, int, int, list[int]]], list[int]]:
    steps, ids, offset = [], [], 0
    for seq, n in batch:
        start = seq.num_computed_tokens
        ids.extend(seq.all_token_ids[start: start + n])
        steps.append((seq.slot, start, n, offset, list(seq.block_table)))
        offset += n
    return steps, ids


def _to_steps(desc: list[tuple[int, int, int, int, list[int]]]) -> list[SeqStep]:
    return [SeqStep(slot=s, start=st, n=n, token_start=off, block_table=torch.tensor(bt, dtype=torch.long))
            for s, st, n, off, bt in desc]


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
        elif msg[0] == "stop":
            return
        else:
            raise RuntimeError(f"unknown message from rank 0: {msg[0]!r}")
