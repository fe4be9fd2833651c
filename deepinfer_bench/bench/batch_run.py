"""The one driver every timing command uses: a batch of greedy requests through the engine's own step.

`run_batch(engine, prompts, max_tokens)` queues the prompts as requests (greedy, `ignore_eos`, `max_tokens` each) on
an `LLMEngine` and calls `engine.step()` until they finish, timing every step. Because it goes through the engine
step (scheduler, chunked prefill, runner, sampler) rather than calling the runner itself, whatever the step does -
speculative decoding, prefill graphs, a new backend - reaches `bench matrix`, `regions` and `bench engine-vs-hf`
alike. `on_step(index, seconds, decoding)` runs after each step (`decoding`: every request had its first token
before this step), e.g. to reset a timer after the warm-up steps.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["BatchRun", "random_prompts", "run_batch"]


@dataclass
class BatchRun:
    ttft_s: float  # from queueing the batch until EVERY request has its first token
    e2e_s: float  # queueing to the last token
    step_s: list[float] = field(default_factory=list)  # every engine step, in order
    first_decode_step: int = 0  # index in step_s of the first step after every request had its first token

    @property
    def decode_steps_s(self) -> list[float]:
        """The steps after the last first token: one token for every request each."""
        return self.step_s[self.first_decode_step:]


def random_prompts(vocab_size: int, batch: int, length: int, seed: Any) -> list[list[int]]:
    """`batch` prompts of `length` random token ids, clear of the low (BOS/EOS-like) ids."""
    rng = random.Random(seed)
    lo = 2 if vocab_size > 2 else 0
    return [[rng.randrange(lo, vocab_size) for _ in range(length)] for _ in range(batch)]


def run_batch(engine: Any, prompts: Sequence[Sequence[int]], max_tokens: int,
              on_step: Callable[[int, float, bool], None] | None = None) -> BatchRun:
    """Every prompt as a greedy request of `max_tokens` tokens through `engine.step()`; the timings of the run."""
    from engine.sampler import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    pending = {engine.add_request(list(p), params) for p in prompts}
    run = BatchRun(ttft_s=0.0, e2e_s=0.0)
    while engine.has_unfinished():
        decoding = not pending
        ts = time.perf_counter()
        outs = engine.step()
        te = time.perf_counter()
        run.step_s.append(te - ts)
        if pending:
            pending -= {o.request_id for o in outs if o.new_token_ids}
            if not pending:
                run.ttft_s = te - t0
                run.first_decode_step = len(run.step_s)
        if on_step is not None:
            on_step(len(run.step_s) - 1, te - ts, decoding)
    run.e2e_s = time.perf_counter() - t0
    if pending:  # aborted before every first token: TTFT is the whole run
        run.ttft_s, run.first_decode_step = run.e2e_s, len(run.step_s)
    return run
