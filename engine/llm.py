"""vLLM-shaped serving loop: `LLMEngine` (add_request / abort / step). `LLM(config).generate(...)` is in
engine/offline.py.

One `step()` = schedule (pure Python) -> reset released slots -> `runner.execute(batch)` -> one batched sampler
call for the sequences whose chunk reached their last token -> stop checks (token ids, EOS, stop strings on the
incrementally detokenised text: the engine is their one owner) -> free finished sequences. The runner is built
with the engine by `engine.build(config)` / `engine.run_job` (engine/launch.py); tests pass a fake one.

`on_logits(request_ids, logits)`, when set, sees the fp32 logits [B, V] every sampled token of a step is drawn
from, before sampling (the golden check records them; logprobs are computed from the same rows).

Logprobs (`SamplingParams.logprobs` / `prompt_logprobs`, vLLM's names): a sampled token's come from the row it was
sampled from; a prompt's need the logits at every prompt position, so for a sequence that asks for them the runner
returns every row of its prefill chunk (`execute(batch, full_logits=...)`), chunk by chunk; positions already
recorded before a preemption are not recorded again. The prompt's list arrives once, with the first token.
"""

from __future__ import annotations

import itertools
import random
import time
from collections.abc import Callable
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass, field
from typing import Protocol

import torch

from engine.config import EngineConfig
from engine.detokenizer import TextState
from engine.sampler import Sampler, SamplingParams, TokenLogprobs, make_generator, token_logprobs
from engine.scheduler import RequestRejected, ScheduledBatch, Scheduler
from engine.sequence import Sequence, SequenceStatus
from engine.speculative import DraftRequest, SpecPolicy, SpecStats, accept
from engine.tokenizer import Tokenizer, load_tokenizer

__all__ = ["EngineConfig", "EngineStats", "LLMEngine", "RequestOutput", "RequestRejected", "SamplingParams",
           "TokenLogprobs", "check_token_ids"]


class ModelRunnerLike(Protocol):
    max_num_seqs: int
    num_kv_blocks: int
    block_size: int
    max_model_len: int

    def execute(self, batch: list[tuple[Sequence, int]], full_logits: SequenceABC[int] = ()) -> torch.Tensor:
        """fp32 logits: per entry in batch order, every row of its chunk for the entry indices in `full_logits`,
        else the chunk's last row."""

    def free_slot(self, slot: int) -> None: ...

    # prefix caching (engine/kv_cache.py): save a slot's state to a snapshot, restore a slot from one
    def save_prefix_state(self, slot: int, snap: int) -> None: ...

    def restore_prefix_state(self, slot: int, snap: int) -> None: ...


@dataclass(frozen=True)
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    output_token_ids: list[int]
    finished: bool
    finish_reason: str | None  # 'stop' | 'length' | 'abort' once finished
    prompt_len: int
    # Detokenised output ("" without a tokenizer): `text` is everything released so far (cut before a stop string),
    # `text_delta` what this output added (text that could start a stop string is held back until it cannot).
    text: str = ""
    text_delta: str = ""
    stop_reason: str | int | None = None  # the stop string or stop token id that finished the request
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0
    logprobs: list[TokenLogprobs] | None = None  # one per new token, when the request asked for logprobs
    # prompt_logprobs: one per prompt token, the first None (nothing predicts it), in the output of the first token
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    num_draft_tokens: int = 0  # speculative decoding: drafts verified for this request so far, and accepted
    num_accepted_tokens: int = 0


def check_token_ids(ids: SequenceABC[int], vocab_size: int) -> list[int]:
    """`ids` as ints, or ValueError naming the first id outside [0, vocab_size)."""
    ids = [int(t) for t in ids]
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(f"token id {bad} is out of range [0, {vocab_size}) (the model's vocab_size)")
    return ids


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_kv_blocks: int
    num_used_blocks: int
    num_free_blocks: int
    peak_used_blocks: int  # high-water mark since the engine started or reset_peak_usage()
    kv_usage: float  # used / total blocks
    num_prefill_tokens: int  # tokens processed in prefill chunks (recomputation after preemption included)
    num_generated_tokens: int
    num_preemptions: int
    num_finished: int
    num_steps: int
    # speculative decoding (vLLM's spec_decode counters): verify steps with drafts, drafted and accepted tokens,
    # accepted drafts per draft position
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: tuple[int, ...] = ()
    # prefix caching (vLLM's prefix_cache_queries / _hits): prompt tokens looked up at admission, and found cached
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0


@dataclass
class _Counters:
    prefill_tokens: int = 0
    generated_tokens: int = 0
    finished: int = 0
    steps: int = 0
    pending: list[RequestOutput] = field(default_factory=list)


class LLMEngine:
    """The serving loop over one runner. Built by `engine.build(config)` (engine/launch.py: the one way, which sets
    the process up first) or by `engine.run_job` on cp ranks; tests hand in a fake runner."""

    def __init__(self, config: EngineConfig, runner: ModelRunnerLike, *, tokenizer: Tokenizer | None = None) -> None:
        self.config = config
        self.model_config = config.model.config
        self.scheduler = Scheduler(config.scheduler_cache,
                                   config.graph.scheduler_buckets(config.cache.max_num_batched_tokens))
        self.scheduler.need_next_token = config.spec.enabled
        self.scheduler.chunk_taps = bool(getattr(runner, "chunk_taps", False))
        self.sampler = Sampler()
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(config.model.model_dir)
        self.eos_token_id = self.model_config.eos_token_id
        self.vocab_size = self.model_config.vocab_size
        self.on_logits: Callable[[list[str], torch.Tensor], None] | None = None
        cache = config.cache
        for name in ("max_num_seqs", "num_kv_blocks", "max_model_len"):
            have = getattr(runner, name, None)
            if have is not None and have < getattr(cache, name):
                raise ValueError(f"runner.{name}={have} < config.{name}={getattr(cache, name)}")
        if getattr(runner, "block_size", cache.block_size) != cache.block_size:
            raise ValueError(f"runner.block_size={runner.block_size} != config.block_size={cache.block_size}")
        self.runner = runner
        self._requests: dict[str, Sequence] = {}
        self._text: dict[str, TextState] = {}
        self._ids = itertools.count()
        self._rng = random.Random(config.seed)
        self._c = _Counters()
        self.spec_stats = SpecStats()
        spec = config.spec
        # the policy times steps with the runner's clock; a runner without one (test fakes) speculates every step
        clock = getattr(runner, "cost_clock", None)
        self.spec_policy = SpecPolicy(spec.num_speculative_tokens, spec.policy if clock else "always",
                                      clock or time.perf_counter) if spec.enabled else None
        self._defers = bool(getattr(runner, "defers_catch_up", False))  # the draft head may put a catch-up off

    # ---- requests -------------------------------------------------------------------------------------------
    def encode(self, prompt: str | SequenceABC[int]) -> list[int]:
        """Token ids of a prompt: a string through the tokenizer, or ids checked against the vocabulary."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"text prompt given but the model directory ({self.config.model.model_dir}) has "
                                 "no tokenizer.json: pass token ids instead")
            return self.tokenizer.encode(prompt)
        return check_token_ids(prompt, self.vocab_size)

    def add_request(self, prompt: str | SequenceABC[int], params: SamplingParams | None = None,
                    request_id: str | None = None, *, arrival_time: float | None = None) -> str:
        """Queue a request; returns its id. Raises RequestRejected if it could never fit this engine, ValueError for
        a bad prompt (token id outside the vocabulary, text without a tokenizer, stop strings without one)."""
        params = params or SamplingParams()
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer (no tokenizer.json in the model directory); "
                             "use stop_token_ids")
        ids = self.encode(prompt)
        order = next(self._ids)
        rid = str(order) if request_id is None else str(request_id)
        if rid in self._requests and not self._requests[rid].is_finished:
            raise ValueError(f"request id {rid!r} is already in use")
        try:
            self.scheduler.check_request(len(ids), params.max_tokens)
        except RequestRejected as e:
            raise RequestRejected(f"request {rid!r} rejected: {e}") from None
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        gen = None if params.greedy else make_generator(seed)
        seq = Sequence(rid, ids, params, arrival_time=arrival_time, order=order, generator=gen)
        self.scheduler.add(seq)
        self._requests[rid] = seq
        if self.tokenizer is not None:
            self._text[rid] = TextState(self.tokenizer.decode, ids, params.stop)
        return rid

    def abort(self, request_id: str) -> bool:
        """Abort a request; its blocks and slot return at once. Its final output comes with the next step()."""
        seq = self._requests.get(request_id)
        if seq is None or seq.is_finished:
            return False
        self.scheduler.finish(seq, "abort")
        delta = self._finish_text(seq)
        self._release_slots()
        self._c.pending.append(self._output(seq, [], delta))
        self._c.finished += 1
        return True

    def get_sequence(self, request_id: str) -> Sequence | None:
        return self._requests.get(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._c.pending)

    # ---- one step -------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one engine step; returns an output for every request that got a token or finished."""
        outputs, self._c.pending = self._c.pending, []
        batch = self.scheduler.schedule()
        self._release_slots()
        for slot, snap in self.scheduler.take_restores():  # prefix hits: the slot state at the cached prefix
            self.runner.restore_prefix_state(slot, snap)
        if batch.is_empty:
            return outputs
        outputs += self._execute(batch)
        self._release_slots()
        return outputs

    def _execute(self, batch: ScheduledBatch) -> list[RequestOutput]:
        sample = batch.sample_indices  # before advance(): chunks that end at the last token (and its drafts)
        verify = {i for i in sample if batch.entries[i][0].draft_token_ids}
        drafts = {i: list(batch.entries[i][0].draft_token_ids) for i in verify}
        num_decode = sum(1 + len(s.draft_token_ids) for s, n in batch.entries
                         if s.num_output_tokens and s.num_uncomputed_tokens == 1)
        starts = [s.num_computed_tokens for s, _ in batch.entries]
        full = sorted({i for i, (s, n) in enumerate(batch.entries) if _new_prompt_targets(s, starts[i], n)} | verify)
        # [R, V] fp32: per entry its chunk's last row, or every row of the chunk for the entries in `full`
        clock = self.spec_policy.clock if self.spec_policy is not None else time.perf_counter
        t0 = clock()
        logits = self.runner.execute(batch.entries, full) if full else self.runner.execute(batch.entries)
        decode_only = batch.num_batched_tokens == num_decode
        self.scheduler.advance(batch)
        self._c.steps += 1
        self._c.prefill_tokens += batch.num_batched_tokens - num_decode
        first_row, row = [], 0
        for i, (seq, n) in enumerate(batch.entries):
            first_row.append(row)
            if i in full:
                if i not in verify:
                    self._record_prompt_logprobs(seq, starts[i], logits[row:row + n])
                row += n
            else:
                row += 1
        plain = [i for i in sample if i not in verify]
        emitted: dict[int, tuple[list[int], torch.Tensor]] = {}  # entry -> (tokens, the rows they come from)
        if plain:
            seqs = [batch.entries[i][0] for i in plain]
            rows = logits[[first_row[i] + (batch.entries[i][1] - 1 if i in full else 0) for i in plain]]  # [Bs, V]
            tokens = self.sampler(rows, [s.sampling_params for s in seqs], [s.generator for s in seqs])
            emitted.update({i: ([tok], rows[j: j + 1]) for j, (i, tok) in enumerate(zip(plain, tokens, strict=True))})
        for i in sorted(verify):
            seq, n = batch.entries[i]
            rows = logits[first_row[i]: first_row[i] + n]  # [1 + k, V]
            toks, accepted = accept(rows, drafts[i], seq.sampling_params, seq.generator)
            self.spec_stats.add(len(drafts[i]), accepted)
            self.spec_policy.observe(len(drafts[i]), accepted, seq.seq_id)
            seq.num_draft_tokens += len(drafts[i])
            seq.num_accepted_tokens += accepted
            emitted[i] = (toks, rows[: len(toks)])
        if self.on_logits is not None and emitted:
            order = sorted(emitted)
            self.on_logits([batch.entries[i][0].seq_id for i in order for _ in emitted[i][0]],
                           torch.cat([emitted[i][1] for i in order]))
        outputs = [self._emit(batch.entries[i][0], *emitted[i], i in verify) for i in sorted(emitted)]
        if self.spec_policy is not None and decode_only and len(verify) in (0, len(batch.entries)):
            # the whole target step, sampling and acceptance included (a verify step's are dearer per sequence);
            # not kept where a sequence verified fewer than k drafts (near its max_tokens: a cheaper step)
            k = self.config.spec.num_speculative_tokens
            self.spec_policy.record("verify" if verify else "plain", len(batch.entries),
                                    clock() - t0 if all(len(d) == k for d in drafts.values()) else None)
        if self.config.spec.enabled:
            self._draft(batch, starts, decode_only)
        for slot, snap in self.scheduler.take_snapshots(batch, starts, self.config.spare_positions):
            self.runner.save_prefix_state(slot, snap)
        return outputs

    def _emit(self, seq: Sequence, tokens: list[int], rows: torch.Tensor, verified: bool) -> RequestOutput:
        """Append `tokens` (each sampled from its row of `rows`) to `seq` one by one, stopping at the first that
        finishes it (a stop token or string, max_tokens, max_model_len): the rest are dropped. One output."""
        now = time.perf_counter()
        p = seq.sampling_params
        kept, delta, stop_reason = [], "", None
        for tok in tokens:
            seq.append_token(tok, now)
            kept.append(tok)
            self._c.generated_tokens += 1
            reason, stop_reason, d = self._check_stop(seq, tok)
            delta += d
            if reason is not None:
                self.scheduler.finish(seq, reason)
                self._c.finished += 1
                break
        if verified:
            self.scheduler.settle(seq)
        lps = None
        if p.logprobs is not None:
            lps = token_logprobs(rows[: len(kept)], kept, [p.logprobs] * len(kept))
        prompt_lps = None
        if p.prompt_logprobs is not None and seq.num_output_tokens == len(kept):  # the first token(s)
            prompt_lps = [None, *seq.prompt_logprobs]
        return self._output(seq, kept, delta, stop_reason, lps, prompt_lps)

    def _draft(self, batch: ScheduledBatch, starts: list[int], decode_only: bool) -> None:
        """After a step: the draft head catches up over every position whose target state is now final and
        proposes drafts for the sequences that decode next (engine/runner.py `draft`), unless the policy says the
        next step does not speculate (`SpecPolicy`: then no drafts, and the head may put its catch-up off). Sampled
        requests draft whatever the policy says: how many uniforms a step draws from their generator depends on
        whether it verifies, and their tokens must be a function of their seed, not of the machine's timing."""
        k = self.config.spec.num_speculative_tokens
        decoding, ids = [], []
        held: list | None = []  # (entry, slot, position, next id) while every entry is a greedy one-token decode
        for i, (seq, _) in enumerate(batch.entries):  # one pass: an off step's Python is most of what it costs
            done = seq.num_computed_tokens
            decoding.append(seq.status is SequenceStatus.RUNNING and done > starts[i]
                            and seq.num_uncomputed_tokens == 1)
            if decoding[-1]:
                ids.append(seq.seq_id)
                if held is not None and done == starts[i] + 1 and seq.sampling_params.greedy:
                    held.append((i, seq.slot, starts[i], seq.all_token_ids[done]))
                    continue
            held = None
        on = self.spec_policy.speculate(len(ids), ids, bool(self.scheduler.waiting))
        # a probe of the acceptance drafts for one sequence: a verify step of B + k rows, not B * (k + 1)
        one = self.spec_policy.pick(ids) if on and self.spec_policy.probe_one and ids else None
        if not on and self._defers and held:
            # off, every entry a greedy one-token decode: each only keeps its final streams for a later resume
            t0 = self.spec_policy.clock()
            self.runner.hold(held)
            if decode_only:
                self.spec_policy.record("catch_up", len(batch.entries), self.spec_policy.clock() - t0)
            for seq, _ in batch.entries:
                seq.draft_token_ids = []
            return
        requests, bm = [], self.scheduler.block_manager
        for i, (seq, _) in enumerate(batch.entries):
            if seq.status is not SequenceStatus.RUNNING or seq.num_computed_tokens <= starts[i]:
                continue
            n_final = seq.num_computed_tokens - starts[i]  # the chunk, or the last token + accepted drafts
            end = starts[i] + n_final
            room = min(k, seq.sampling_params.max_tokens - seq.num_output_tokens - 1,
                       self.config.cache.max_model_len - seq.num_tokens) if decoding[i] else 0
            if decoding[i] and room <= 0 and not bm.may_snapshot(seq, starts[i], self.config.spare_positions):
                # its next token is its last (length): no later draft reads what a catch-up would write, and no
                # prefix snapshot keeps it
                seq.draft_token_ids = []
                continue
            drafts = (on and one in (None, seq.seq_id)) or not seq.sampling_params.greedy
            defer = decoding[i] and not drafts and self._defers
            requests.append(DraftRequest(entry=i, slot=seq.slot, start=starts[i], n=n_final,
                                         block_table=[] if defer else list(seq.block_table),  # (held only)
                                         want=max(0, room) if drafts else 0,
                                         next_ids=seq.all_token_ids[starts[i] + 1: end + 1], defer=defer))
        if not requests:
            return
        t0 = self.spec_policy.clock()
        drafted = self.runner.draft(requests)
        if decode_only and one is None and (on or not any(r.want for r in requests)):
            full = not on or all(r.want == k for r in requests)  # (as a verify step of fewer drafts: not kept)
            self.spec_policy.record("draft" if on else "catch_up", len(requests),
                                    self.spec_policy.clock() - t0 if full else None)
        for req, toks in zip(requests, drafted, strict=True):
            seq = batch.entries[req.entry][0]
            seq.draft_token_ids = list(toks[: req.want])

    @staticmethod
    def _record_prompt_logprobs(seq: Sequence, start: int, chunk: torch.Tensor) -> None:
        """Append the logprobs of the prompt tokens this chunk's rows [n, V] predict and that are not recorded yet
        (row r, at position start + r, predicts token start + r + 1)."""
        first, end = _new_prompt_targets(seq, start, chunk.shape[0])
        ids = seq.all_token_ids[first:end]
        rows = chunk[first - 1 - start:end - 1 - start]
        seq.prompt_logprobs += token_logprobs(rows, ids, [seq.sampling_params.prompt_logprobs] * len(ids))

    def _check_stop(self, seq: Sequence, tok: int) -> tuple[str | None, str | int | None, str]:
        """(finish reason, stop reason, released text) after `tok` was appended to `seq`."""
        p, n = seq.sampling_params, seq.num_output_tokens
        text = self._text.get(seq.seq_id)
        if n >= p.min_tokens and (tok in p.stop_token_ids or (not p.ignore_eos and tok == self.eos_token_id)):
            # a stop token ends the text without being part of it (vLLM)
            return "stop", (tok if tok in p.stop_token_ids else None), self._finish_text(seq)
        length = n >= p.max_tokens or seq.num_tokens >= self.config.cache.max_model_len
        delta = ""
        if text is not None:
            delta = text.push(tok, final=length, check_stop=n >= p.min_tokens)
            seq.output_text = text.text
            if text.stop_hit is not None:
                return "stop", text.stop_hit, delta
        return ("length" if length else None), None, delta

    def _finish_text(self, seq: Sequence) -> str:
        text = self._text.get(seq.seq_id)
        if text is None:
            return ""
        delta = text.finish()
        seq.output_text = text.text
        return delta

    def _output(self, seq: Sequence, new: list[int], delta: str = "", stop_reason: str | int | None = None,
                logprobs: list[TokenLogprobs] | None = None,
                prompt_logprobs: list[TokenLogprobs | None] | None = None) -> RequestOutput:
        if seq.is_finished:  # a finished request is forgotten (a long-running server must not grow with each one)
            self._text.pop(seq.seq_id, None)
            self._requests.pop(seq.seq_id, None)
        return RequestOutput(request_id=seq.seq_id, new_token_ids=new, output_token_ids=seq.output_token_ids,
                             finished=seq.is_finished, finish_reason=seq.finish_reason,
                             prompt_len=seq.num_prompt_tokens, text=seq.output_text, text_delta=delta,
                             stop_reason=stop_reason, arrival_time=seq.arrival_time,
                             first_token_time=seq.first_token_time, finished_time=seq.finished_time,
                             num_preemptions=seq.num_preemptions, logprobs=logprobs,
                             prompt_logprobs=prompt_logprobs, num_draft_tokens=seq.num_draft_tokens,
                             num_accepted_tokens=seq.num_accepted_tokens)

    def _release_slots(self) -> None:
        for slot in self.scheduler.take_freed_slots():
            self.runner.free_slot(slot)

    # ---- metrics --------------------------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        bm = self.scheduler.block_manager
        return EngineStats(num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
                           num_kv_blocks=bm.num_blocks, num_used_blocks=bm.num_used_blocks,
                           num_free_blocks=bm.num_free_blocks, peak_used_blocks=bm.peak_used_blocks,
                           kv_usage=bm.usage,
                           num_prefill_tokens=self._c.prefill_tokens, num_generated_tokens=self._c.generated_tokens,
                           num_preemptions=self.scheduler.num_preemptions, num_finished=self._c.finished,
                           num_steps=self._c.steps, spec_num_drafts=self.spec_stats.num_drafts,
                           spec_num_draft_tokens=self.spec_stats.num_draft_tokens,
                           spec_num_accepted_tokens=self.spec_stats.num_accepted_tokens,
                           spec_accepted_per_pos=tuple(self.spec_stats.accepted_per_pos),
                           prefix_cache_queries=self.scheduler.prefix_queries,
                           prefix_cache_hits=self.scheduler.prefix_hits)

    def reset_peak_usage(self) -> None:
        self.scheduler.block_manager.reset_peak()


def _new_prompt_targets(seq: Sequence, start: int, n: int) -> tuple[int, int] | None:
    """The prompt tokens [first, end) whose logprobs a chunk of `n` tokens from position `start` yields and `seq`
    has not recorded yet (token t is predicted by position t - 1); None when there are none (or none were asked)."""
    if seq.sampling_params.prompt_logprobs is None:
        return None
    first = max(start + 1, len(seq.prompt_logprobs) + 1)
    end = min(start + n + 1, seq.num_prompt_tokens)
    return (first, end) if first < end else None


def greedy_with_logits(engine: LLMEngine, prompts: SequenceABC[SequenceABC[int]],
                       max_new_tokens: int | SequenceABC[int], on_step: Callable[[], None] | None = None,
                       finals: list[RequestOutput] | None = None) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Every prompt as a greedy request (`ignore_eos`, `max_tokens` each) through `engine`'s scheduler; returns per
    prompt the generated ids and the fp32 logits [n, vocab] each of them was sampled from (`drive_with_logits`)."""
    return drive_with_logits(engine, prompts, max_new_tokens, on_step=on_step, finals=finals)


def drive_with_logits(engine: LLMEngine, prompts: SequenceABC[SequenceABC[int]],
                      max_new_tokens: int | SequenceABC[int] | None = None,
                      forced: SequenceABC[SequenceABC[int]] | None = None, on_step: Callable[[], None] | None = None,
                      finals: list[RequestOutput] | None = None) -> tuple[list[list[int]], list[torch.Tensor]]:
    """The one greedy / teacher-forced driver: every prompt as a greedy request (`ignore_eos`, `max_tokens` each)
    through `engine`'s scheduler - the loop the server runs - recording the fp32 logits [n, vocab] of every emitted
    token (via `on_logits`). With `forced`, the sampler is replaced by the given tokens (teacher forcing: every step
    is scored on the reference's own context; `max_tokens` = their count) and the returned ids are those tokens;
    else the ids are the engine's greedy picks. `on_step()` runs after every engine step (the golden reads device
    counters there); `finals` receives each prompt's final RequestOutput (in prompt order)."""
    import torch

    if forced is not None:
        news = [len(f) for f in forced]
    elif max_new_tokens is None:
        raise ValueError("drive_with_logits needs max_new_tokens or forced")
    else:
        news = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else list(max_new_tokens)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in news]
    rows: dict[str, list[torch.Tensor]] = {}

    def record(request_ids: list[str], logits: torch.Tensor) -> None:
        for rid, row in zip(request_ids, logits, strict=True):
            rows.setdefault(rid, []).append(row.float().clone())

    prev, sampler = engine.on_logits, engine.sampler
    engine.on_logits = record
    if forced is not None:
        queue = {id(p): list(f) for p, f in zip(params, forced, strict=True)}
        engine.sampler = lambda logits, ps, gens: [queue[id(p)].pop(0) for p in ps]
    try:
        rids = [engine.add_request(list(p), sp) for p, sp in zip(prompts, params, strict=True)]
        outs: dict[str, list[int]] = {}
        last: dict[str, RequestOutput] = {}
        while engine.has_unfinished():
            for o in engine.step():
                if o.finished:
                    outs[o.request_id] = list(o.output_token_ids)
                    last[o.request_id] = o
            if on_step is not None:
                on_step()
    finally:
        engine.on_logits, engine.sampler = prev, sampler
    if finals is not None:
        finals.extend(last[r] for r in rids)
    return [outs[r] for r in rids], [torch.stack(rows[r]) for r in rids]
