"""`Sequence`: one request's tokens, its place in the KV pool, and its timestamps (nano-vllm `sequence.py` shape).

Token bookkeeping is position arithmetic: tokens `[0, num_computed_tokens)` are in the KV state of `slot` and the
blocks of `block_table`; the next engine step processes `all_token_ids[num_computed_tokens : +n]`. When a step
reaches the last token, the sampled token is appended and exactly one token is again uncomputed (decode). A
preempted sequence drops its state (`num_computed_tokens = 0`) and recomputes prompt + output so far. With
speculative decoding a decode step also processes the sequence's `draft_token_ids` after its last token (a verify
step); the accepted ones and a bonus token are appended, and the state past them is simply not counted as
computed (engine/model/cache.py keeps spare rows for them).
"""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from engine.sampler import SamplingParams, TokenLogprobs


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


FINISH_REASONS = ("stop", "length", "abort")


class Sequence:
    """A request inside the engine. Identity-hashed (two sequences with equal tokens are different requests)."""

    def __init__(self, seq_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams, *,
                 arrival_time: float | None = None, order: int = 0,
                 generator: torch.Generator | None = None) -> None:
        if not prompt_token_ids:
            raise ValueError(f"request {seq_id!r}: prompt_token_ids is empty")
        self.seq_id = seq_id
        self._token_ids: list[int] = [int(t) for t in prompt_token_ids]
        self.num_prompt_tokens = len(self._token_ids)
        self.sampling_params = sampling_params
        self.generator = generator
        self.order = order  # arrival rank: lower = older = higher priority
        self.status = SequenceStatus.WAITING
        self.slot: int | None = None
        self.block_table: list[int] = []
        self.num_computed_tokens = 0
        # prefix caching (engine/kv_cache.py): chain hashes of the full blocks hashed so far (they depend on the
        # tokens only, so they survive a preemption), and how many of block_table's blocks are keyed in the cache
        self.block_hashes: list[bytes] = []
        self.num_cached_blocks = 0
        self.num_cached_tokens = 0  # prompt positions the last admission took from the prefix cache
        self.snap_taps: tuple[tuple[int, int], ...] = ()  # this step's (block boundary, snapshot) saves (runner)
        self.finish_reason: str | None = None
        self.output_text = ""  # detokenised output (engine fills it when a tokenizer is present)
        self.num_preemptions = 0
        # `sampling_params.prompt_logprobs`: those of prompt tokens 1.. so far (kept across a preemption).
        self.prompt_logprobs: list[TokenLogprobs] = []
        # Speculative decoding: tokens a draft head proposed after the last token (not part of the output until the
        # target accepts them), and the draft distributions they were drawn from ([k, V] fp32; rejection sampling).
        self.draft_token_ids: list[int] = []
        self.draft_logits: torch.Tensor | None = None
        self.num_draft_tokens = 0  # drafts this request's verify steps carried
        self.num_accepted_tokens = 0  # of which the target accepted
        # Metrics (time.perf_counter() seconds).
        self.arrival_time = time.perf_counter() if arrival_time is None else arrival_time
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.finished_time: float | None = None

    # ---- tokens ---------------------------------------------------------------------------------------------
    @property
    def all_token_ids(self) -> list[int]:
        """Prompt + output tokens. The live list (not a copy): callers slice it, never mutate it."""
        return self._token_ids

    @property
    def prompt_token_ids(self) -> list[int]:
        return self._token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self._token_ids[self.num_prompt_tokens:]

    @property
    def num_tokens(self) -> int:
        return len(self._token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self._token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self._token_ids) - self.num_computed_tokens

    def step_token_ids(self, start: int, n: int) -> list[int]:
        """Tokens at positions [start, start + n): the sequence's own, then its drafts (a verify step)."""
        toks = self._token_ids[start: start + n]
        if len(toks) < n:
            toks = toks + self.draft_token_ids[: n - len(toks)]
        return toks

    def clear_drafts(self) -> None:
        self.draft_token_ids = []
        self.draft_logits = None

    @property
    def last_token_id(self) -> int:
        return self._token_ids[-1]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def append_token(self, token_id: int, now: float | None = None) -> None:
        self._token_ids.append(int(token_id))
        now = time.perf_counter() if now is None else now
        if self.first_token_time is None:
            self.first_token_time = now
        self.last_token_time = now

    # ---- metrics --------------------------------------------------------------------------------------------
    @property
    def ttft_s(self) -> float | None:
        """Arrival to first generated token (includes queueing), seconds."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first (vLLM's TPOT), seconds; None with fewer than 2 tokens."""
        if self.first_token_time is None or self.last_token_time is None or self.num_output_tokens < 2:
            return None
        return (self.last_token_time - self.first_token_time) / (self.num_output_tokens - 1)

    def __repr__(self) -> str:
        return (f"Sequence({self.seq_id!r}, status={self.status.value}, tokens={self.num_prompt_tokens}+"
                f"{self.num_output_tokens}, computed={self.num_computed_tokens}, slot={self.slot}, "
                f"blocks={len(self.block_table)})")
