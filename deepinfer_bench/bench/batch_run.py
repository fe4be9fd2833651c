"""The one driver every timing command uses: a batch of greedy requests through the engine's own step.

`run_batch(engine, prompts, max_tokens)` queues the prompts as requests (greedy, `ignore_eos`, `max_tokens` each) on
an `LLMEngine` and calls `engine.step()` until they finish, timing every step. Because it goes through the engine
step (scheduler, chunked prefill, runner, sampler) rather than calling the runner itself, whatever the step does -
speculative decoding, prefill graphs, a new backend - reaches `bench matrix`, `regions` and `bench engine-vs-hf`
alike. `on_step(index, seconds, decoding)` runs after each step (`decoding`: every request had its first token
before this step), e.g. to reset a timer after the warm-up steps.
`run_lockstep(engines, prompts, max_tokens)` runs the same batch on several engines at once, one step of each in
turn: an A/B where every setting's steps fall within milliseconds of the others' (a shared VM's speed swings over
seconds; whole batches run one after another catch different phases).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["BatchRun", "random_prompts", "run_batch", "run_lockstep"]


@dataclass
class BatchRun:
    ttft_s: float  # from queueing the batch until EVERY request has its first token
    e2e_s: float  # queueing to the last token
    step_s: list[float] = field(default_factory=list)  # every engine step, in order
    first_decode_step: int = 0  # index in step_s of the first step after every request had its first token
    # the process's CPU seconds of each step (with one torch thread, the time other load on a shared box does not
    # inflate)
    step_cpu_s: list[float] = field(default_factory=list)

    @property
    def decode_steps_s(self) -> list[float]:
        """The steps after the last first token: one token for every request each."""
        return self.step_s[self.first_decode_step:]

    @property
    def decode_cpu_s(self) -> list[float]:
        return self.step_cpu_s[self.first_decode_step:]


class _Tracked:
    """One engine's batch of requests and the timings of its steps."""

    def __init__(self, engine: Any, prompts: Sequence[Sequence[int]], max_tokens: int) -> None:
        from engine.sampler import SamplingParams

        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        self.engine, self.t0 = engine, time.perf_counter()
        self.pending = {engine.add_request(list(p), params) for p in prompts}
        self.run = BatchRun(ttft_s=0.0, e2e_s=0.0)

    def step(self) -> tuple[float, bool]:
        """One engine step: (its seconds, whether every request had its first token before it)."""
        run, decoding = self.run, not self.pending
        ts, cs = time.perf_counter(), time.process_time()
        outs = self.engine.step()
        ce, te = time.process_time(), time.perf_counter()
        run.step_s.append(te - ts)
        run.step_cpu_s.append(ce - cs)
        if self.pending:
            self.pending -= {o.request_id for o in outs if o.new_token_ids}
            if not self.pending:
                run.ttft_s = te - self.t0
                run.first_decode_step = len(run.step_s)
        return te - ts, decoding

    def done(self) -> BatchRun:
        run = self.run
        run.e2e_s = time.perf_counter() - self.t0
        if self.pending:  # aborted before every first token: TTFT is the whole run
            run.ttft_s, run.first_decode_step = run.e2e_s, len(run.step_s)
        return run


def random_prompts(vocab_size: int, batch: int, length: int, seed: Any) -> list[list[int]]:
    """`batch` prompts of `length` random token ids, clear of the low (BOS/EOS-like) ids."""
    rng = random.Random(seed)
    lo = 2 if vocab_size > 2 else 0
    return [[rng.randrange(lo, vocab_size) for _ in range(length)] for _ in range(batch)]


def run_batch(engine: Any, prompts: Sequence[Sequence[int]], max_tokens: int,
              on_step: Callable[[int, float, bool], None] | None = None) -> BatchRun:
    """Every prompt as a greedy request of `max_tokens` tokens through `engine.step()`; the timings of the run."""
    tracked = _Tracked(engine, prompts, max_tokens)
    while engine.has_unfinished():
        seconds, decoding = tracked.step()
        if on_step is not None:
            on_step(len(tracked.run.step_s) - 1, seconds, decoding)
    return tracked.done()


def run_lockstep(engines: Sequence[Any], prompts: Sequence[Sequence[int]], max_tokens: int,
                 first: int = 0) -> list[BatchRun]:
    """`run_batch` of the same prompts on every engine of `engines`, one step of each in turn until all finish; each
    round starts from the next engine (round r from engine `first + r`: the one stepped first, after another
    process's time slice or another engine's prefill, is not always the same). One BatchRun per engine, in order;
    their `ttft_s` / `e2e_s` include the other engines' steps (the step times are each engine's own)."""
    tracked = [_Tracked(e, prompts, max_tokens) for e in engines]
    live, turn = list(range(len(engines))), first
    while live:
        for i in live[turn % len(live):] + live[: turn % len(live)]:
            tracked[i].step()
            if not engines[i].has_unfinished():
                live.remove(i)
        turn += 1
    return [t.done() for t in tracked]
