"""Speculative decoding: which drafted tokens the target accepts, and the numbers that say how well drafting works.

A verify step runs the target over a sequence's last token and its k drafts d_1..d_k (positions t..t+k) and returns
k + 1 logits rows: row i is the target's distribution p_i of the token at t + 1 + i.

* Greedy requests: accept d_1..d_a while d_i = argmax p_{i-1}; the next token is argmax p_a (the "bonus": a
  correction where a draft was wrong, a free extra token where all k were right). The output is exactly the plain
  greedy output.
* Sampled requests (temperature > 0): the standard rejection rule (Leviathan et al. 2023; Chen et al. 2023) with
  the draft distribution q_i = the point mass on d_i (drafts are always the draft head's argmax, so every rank of a
  cp job drafts the same tokens without sharing a generator): accept d_i with probability min(1, p(d_i) / q(d_i)) =
  p(d_i); at the first rejection draw the token from norm(max(0, p - q)) = p with d_i removed; after k acceptances
  draw the bonus from p_k. Each emitted token is then distributed exactly as a token sampled from the target (p
  under the request's own temperature / top-k / top-p, `probs`), whatever the draft head proposed. Uniforms come
  from the request's own generator.

`SpecStats` counts drafts, accepted drafts and accepted drafts per position (vLLM's `spec_decode` counters).
`SpecPolicy` decides per step whether the next step speculates at all (docs/speculative.md).
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from engine.sampler import SamplingParams, top_k_top_p_probs


def probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a request samples from, [R, V] fp32 over the vocabulary (temperature, top-k, top-p)."""
    logits = logits.float()
    if params.top_k <= 0 and params.top_p >= 1:
        return torch.softmax(logits / params.temperature, dim=-1)
    sorted_p, idx = top_k_top_p_probs(logits, [params] * logits.shape[0])
    return torch.zeros_like(sorted_p).scatter_(-1, idx, sorted_p)


def _draw(p: torch.Tensor, generator: torch.Generator) -> int:
    """One token from distribution p [V] with one uniform of `generator` (inverse CDF, as the sampler draws)."""
    u = torch.rand(1, generator=generator)
    cdf = p.cumsum(-1)
    i = int(torch.searchsorted(cdf, u * cdf[-1], right=True))
    last = int((p > 0).nonzero().max())
    return min(i, last)


def accept(target: torch.Tensor, drafts: Sequence[int], params: SamplingParams,
           generator: torch.Generator | None) -> tuple[list[int], int]:
    """(tokens to append, accepted drafts): target [k+1, V] fp32 rows of a verify step, `drafts` the k drafted ids
    (the draft head's argmax). The tokens are the accepted drafts and one more (correction or bonus)."""
    k = len(drafts)
    if target.shape[0] != k + 1:
        raise ValueError(f"a verify step of {k} drafts has {k + 1} target rows, got {target.shape[0]}")
    if params.greedy:
        best = target.argmax(-1).tolist()
        a = 0
        while a < k and drafts[a] == best[a]:
            a += 1
        return [*drafts[:a], int(best[a])], a
    if generator is None:
        raise ValueError("a sampled request's verify step needs its generator")
    p = probs(target, params)
    for i, d in enumerate(drafts):
        if float(torch.rand(1, generator=generator)) < float(p[i, d]):  # accept with probability p(d) / 1
            continue
        residual = p[i].clone()
        residual[d] = 0.0  # max(0, p - q) for q the point mass on d
        if float(residual.sum()) <= 0:  # p is the point mass on d: rejecting had probability 0 (rounding)
            residual = p[i]
        return [*drafts[:i], _draw(residual, generator)], i
    return [*drafts, _draw(p[k], generator)], k


@dataclass
class DraftRequest:
    """One sequence's share of a draft call after a step (engine/llm.py -> runner.draft): the step processed positions
    [start, ...) of `slot` as batch entry `entry`; positions [start, start + n) now have their final target state
    (a prefill chunk: all of it; a verify step: the last token and the accepted drafts) and `next_ids[j]` is the token
    at start + j + 1. `want` drafts are asked for (0: the draft head only catches up over those positions)."""

    entry: int
    slot: int
    start: int
    n: int
    block_table: list[int]
    want: int
    next_ids: list[int]
    defer: bool = False  # speculation is off for the next step: the head may put its catch-up off (runner.draft)


@dataclass
class SpecStats:
    """Cumulative speculation counters (vLLM's spec_decode metrics): verify steps with drafts (`num_drafts`),
    drafted tokens, accepted drafts, and accepted drafts per draft position."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    drafted_per_pos: list[int] = field(default_factory=list)

    def add(self, drafted: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        for lst in (self.accepted_per_pos, self.drafted_per_pos):
            while len(lst) < drafted:
                lst.append(0)
        for i in range(drafted):
            self.drafted_per_pos[i] += 1
            self.accepted_per_pos[i] += int(i < accepted)

    @property
    def acceptance_rate(self) -> float:
        """Accepted / drafted tokens (NaN before any draft)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else float("nan")

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verify step: 1 + accepted drafts (NaN before any)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else float("nan")

    def per_position(self) -> list[float]:
        """Acceptance rate of each draft position."""
        return [a / d if d else float("nan") for a, d in zip(self.accepted_per_pos, self.drafted_per_pos, strict=True)]

    def to_dict(self) -> dict[str, object]:
        """JSON-ready (None where nothing was drafted yet)."""
        def num(x: float) -> float | None:
            return None if x != x else x

        return {"num_drafts": self.num_drafts, "num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": self.num_accepted_tokens, "acceptance_rate": num(self.acceptance_rate),
                "mean_accepted_length": num(self.mean_accepted_length),
                "acceptance_rate_per_position": [num(x) for x in self.per_position()]}


_PARTS = ("verify", "draft", "plain", "catch_up")


class SpecPolicy:
    """Whether the next step speculates (`--speculative-policy auto`; `always`, the default, every step): a decode step
    of B sequences costs `plain(B)` (target step + the draft head's catch-up) without drafts and `spec(B)` (verify
    step + drafting) with them, and a sequence gets E = 1 + sum_j r_j tokens from a verify step (r_j: the running
    rate at which the first j drafts are all accepted). Speculate while E * plain(B) >= (1 + margin) * spec(B): the
    margin keeps a near tie off, since E is a running estimate and a batch whose sequences finish apart pays its
    slowest one's steps. Costs are the median of the last `window` measured steps per batch size, so a spike on a
    shared machine does not flip the choice. Costs come from the batch size itself once measured, else from a
    measured one within a quarter of it; else three speculative steps (and at least 8 verified sequences, for E),
    then three plain ones are measured (the first of each is not kept). Where E < 1 + margin after two verify steps
    nothing is measured: no cost pays for that. While off, one step in `interval` speculates again to refresh the
    rates (the interval doubles up to `max_interval` while it keeps losing; one in 4 while E * plain(B) is within 10
    % of the bar), except where spec(B) > (k + 1) * plain(B) over full windows: then no acceptance could pay and
    nothing is probed. "always" speculates every step. `clock` is the runner's (ModelRunner.cost_clock)."""

    def __init__(self, k: int, policy: str = "auto", clock: Callable[[], float] = time.perf_counter, window: int = 8,
                 interval: int = 32, max_interval: int = 1024, alpha: float = 0.1, margin: float = 0.05) -> None:
        self.k, self.always, self.margin = k, policy == "always", margin
        self.least_seen = 8  # verified sequences before E may turn it off (but for E < 1 + margin)
        self.window, self.base, self.max_interval, self.alpha = window, interval, max_interval, alpha
        self.interval, self.off_steps = interval, 0
        self.clock = clock
        self.rates: list[float] = []
        self.seen: list[int] = []
        self._costs: dict[tuple[str, int], deque[float]] = {}

    def record(self, what: str, batch: int, seconds: float) -> None:
        """A measured decode-only step part: "verify" / "plain" (the target step) or "draft" / "catch_up" (the
        draft head after it, drafting or not), of `batch` sequences. The first of each is dropped: a new row count
        builds its native packs."""
        key = (what, batch)
        if key not in self._costs:
            self._costs[key] = deque(maxlen=self.window)
            return
        self._costs[key].append(seconds)

    def cost(self, what: str, batch: int, least: int = 1) -> float | None:
        """The median of the kept samples, None while fewer than `least`."""
        d = self._costs.get((what, batch))
        return statistics.median(d) if d is not None and len(d) >= least else None

    def observe(self, drafted: int, accepted: int) -> None:
        """One sequence's verify: `accepted` of its `drafted` drafts (a running mean, then an EMA, per position)."""
        while len(self.rates) < drafted:
            self.rates.append(0.0)
            self.seen.append(0)
        for j in range(drafted):
            self.seen[j] += 1
            a = max(self.alpha, 1 / self.seen[j])
            self.rates[j] += a * (float(j < accepted) - self.rates[j])

    def expected_tokens(self) -> float:
        """E: tokens a sequence gets from one verify step at the running rates."""
        return 1 + sum(self.rates[: self.k])

    def speculate(self, batch: int) -> bool:
        """Whether the step after this one speculates, for `batch` decoding sequences."""
        if self.always or not self.seen:
            return True
        if self.seen and self.seen[0] >= 2 and self.expected_tokens() < 1 + self.margin:
            return self._off(probe=True)  # next to nothing accepted: no step cost makes that pay
        # this batch size's costs, else a measured one within a quarter of it (a batch whose sequences finish apart
        # does not measure every size again); else measure it: speculative steps first, then plain ones
        measured = [b for (w, b) in self._costs if w == "verify" and abs(b - batch) <= batch // 4
                    and self._measured(b)]
        if not measured:
            if self.cost("verify", batch, 2) is None or self.cost("draft", batch, 2) is None \
                    or self.seen[0] < self.least_seen:
                return True
            return self._off(probe=False)
        if self.seen[0] < self.least_seen:  # E from a few verifies is too rough to turn it off on
            return True
        at = min(measured, key=lambda b: (abs(b - batch), b))
        spec = self.cost("verify", at) + self.cost("draft", at)
        plain = self.cost("plain", at) + self.cost("catch_up", at)
        gain = self.expected_tokens() * plain / ((1 + self.margin) * spec)
        if gain >= 1:
            self.interval, self.off_steps = self.base, 0
            return True
        if gain >= 0.9:  # a near miss: E may just be low by chance, and it only moves while verifying
            self.interval = min(self.interval, 4)
        settled = all(len(self._costs[(w, at)]) == self.window for w in _PARTS)
        return self._off(probe=not settled or spec <= (self.k + 1) * plain)

    def _measured(self, batch: int) -> bool:
        return all(self.cost(w, batch, 2) is not None for w in _PARTS)

    def _off(self, probe: bool) -> bool:
        self.off_steps += 1
        if probe and self.off_steps >= self.interval:
            self.off_steps, self.interval = 0, min(2 * self.interval, self.max_interval)
            return True
        return False
