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

import bisect
import math
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


class _Costs:
    """One step part's measured cost against the batch size B: the last `window` samples per B (the first at each B
    is dropped: a new row count builds its native packs). `at(B)` is the mean where B is measured, else a line
    through the measured sizes' means (piecewise between them; beyond them the outermost two's slope, never
    below 0; one measured size: its cost), so a batch size never seen costs nothing to estimate."""

    def __init__(self, window: int) -> None:
        self.window = window
        self.samples: dict[int, deque[float]] = {}

    def add(self, batch: int, seconds: float, first: bool = False) -> bool:
        """Keep `seconds` at `batch` (the first at a new size only with `first`); whether it was kept."""
        if batch not in self.samples:
            self.samples[batch] = deque(maxlen=self.window)
            if not first:
                return False
        self.samples[batch].append(seconds)
        return True

    def sizes(self, least: int = 1) -> list[int]:
        return sorted(b for b, d in self.samples.items() if len(d) >= least)

    def mean(self, batch: int, least: int = 1) -> float | None:
        """The mean of the kept samples at `batch` less their largest (what a run of steps costs - a median
        would miss the collector's share of every few steps - but for one spike), None while fewer than `least`."""
        d = self.samples.get(batch)
        if d is None or len(d) < least:
            return None
        return (sum(d) - max(d)) / (len(d) - 1) if len(d) > 2 else statistics.fmean(d)

    def at(self, batch: int) -> float | None:
        sizes = self.sizes()
        if not sizes:
            return None
        if batch in sizes or len(sizes) == 1:
            return self.mean(batch if batch in sizes else sizes[0])
        i = min(max(bisect.bisect_left(sizes, batch), 1), len(sizes) - 1)  # the segment [sizes[i-1], sizes[i]]
        (b0, b1), outside = (sizes[i - 1], sizes[i]), not sizes[0] < batch < sizes[-1]
        c0, c1 = self.mean(b0), self.mean(b1)
        slope = (c1 - c0) / (b1 - b0)
        if outside:
            slope = max(slope, 0.0)
        return max(c0 + slope * (batch - b0), 0.0) if batch < b0 else c1 + slope * (batch - b1)

    def near(self, batch: int, least: int) -> bool:
        """Whether a size within a quarter of `batch` has `least` samples (its estimate is then as good as
        measured: the tail of a batch whose sequences finish apart needs no measuring)."""
        return any(abs(b - batch) <= max(1, batch // 4) for b in self.sizes(least))

    def full(self, batch: int) -> bool:
        return len(self.samples.get(batch, ())) == self.window


class _Rates:
    """Running acceptance: r_j, the rate at which the first j + 1 drafts are all accepted (a running mean over
    the first 1 / alpha verifies, then an EMA with weight alpha), per draft position."""

    def __init__(self, alpha: float, prior: list[float] | None = None, seen: int = 0) -> None:
        self.alpha, self.rates, self.seen = alpha, list(prior or []), [seen] * len(prior or [])

    def add(self, drafted: int, accepted: int) -> None:
        while len(self.rates) < drafted:
            self.rates.append(0.0)
            self.seen.append(0)
        for j in range(drafted):
            self.seen[j] += 1
            a = max(self.alpha, 1 / self.seen[j])
            self.rates[j] += a * (float(j < accepted) - self.rates[j])

    def expected(self, k: int) -> float:
        return 1 + sum(self.rates[:k])


class SpecPolicy:
    """Whether the next step speculates (`--speculative-policy auto`; `always`, the default, every step): a decode step
    of B sequences costs `plain(B)` (target step + the draft head's catch-up) without drafts and `spec(B)` (verify
    step + drafting) with them, and a sequence gets E = 1 + sum_j r_j tokens from a verify step (r_j: the running
    rate at which its first j drafts are all accepted). The gain G(B) = E * plain(B) / ((1 + margin) * spec(B));
    it speculates where G >= 1 (the margin keeps a near tie off: E is a running estimate, and a batch whose
    sequences finish apart pays its slowest one's steps).

    Costs: each of the four parts has its own curve over B (`_Costs`: the last `window` steps per B, interpolated
    between measured sizes; a step where a sequence had fewer than k drafts is not kept), and where a size's verify
    and draft steps were kept against its plain steps, spec(B) is their ratios to those times' plain step times its
    plain step now (a shared machine's speed swings by half between phases); a size needs no measuring of its own
    unless the estimate is unsure: where G is within `band` of 1 and the side not taken has no measured size within a
    quarter of B, that side is measured (3 steps: the first at a new size is dropped); at B > 1 plain steps near B are
    measured before anything turns on or probes there (a line from smaller sizes overshoots a larger one's plain
    cost: a step's fixed share).
    E: the mean over the batch's sequences of each one's own rates (acceptance depends on the text: a sequence's own
    last verifies say more than the engine's), which start from the engine's prior (over every sequence's verifies,
    a slower average than the engine's own rates); at B > 1 with no request waiting, their harmonic mean (no request
    takes the slot of a sequence that finishes early: the batch runs as long as its slowest one); before
    `least_seen` verified sequences it speculates.
    E < 1 + margin after `least_none` verify steps (a draft head that is never right) turns it off with no cost
    needed, probed one step in `interval`, or in as many as keep the probes at `probe_share` of the steps' cost where a
    probe is dearer (doubling up to `max_interval`). On at B = 1, it stays on down to G = 1 / band. Where full
    acceptance could pay, it is probed one step in `probe_every` (doubling while it keeps losing; one in 4 while
    G >= 0.9) and at B = 1 a new sequence speculates once (at B > 1 new sequences wait for a probe); where even full
    acceptance cannot pay ((k + 1) * plain(B) < (1 + margin) * spec(B), the spec side measured) it is off and
    nothing is probed: that decided-off state costs nothing.
    `clock` is the runner's (ModelRunner.cost_clock). `why` says what the last decision rested on."""

    def __init__(self, k: int, policy: str = "auto", clock: Callable[[], float] = time.perf_counter, window: int = 16,
                 interval: int = 32, max_interval: int = 1024, probe_every: int = 8, alpha: float = 0.1,
                 seq_alpha: float = 0.2, margin: float = 0.05, band: float = 1.1, probe_share: float = 0.02,
                 prior_alpha: float = 0.02) -> None:
        self.k, self.always, self.margin, self.band = k, policy == "always", margin, band
        self.least_seen = 8  # verified sequences before E may turn it off (but for E < 1 + margin)
        # verifies with next to nothing accepted before that alone turns it off, no cost needed (a draft head that is
        # never right); two in a row befall a head whose drafts pass or fail as a block (DSpark's) at a cold start
        self.least_none = 4
        self.least = 2  # kept samples that make a batch size measured
        self.base, self.max_interval, self.probe_every = interval, max_interval, probe_every
        self.interval: int | None = None  # probe one off step in this many (None: on)
        self.off_steps, self._every = 0, 0
        self.clock = clock
        self.accepted = _Rates(alpha)  # every sequence's verifies
        # and over more of them: a new sequence's prior (the last few verifies of one text - DSpark's drafts pass or
        # fail as a block - swing E by +-1, and a batch of new sequences would probe or turn on on a swing)
        self.prior = _Rates(prior_alpha)
        self.seq_alpha = seq_alpha
        self._seqs: dict[object, _Rates] = {}  # each decoding sequence's own
        self.parts = {w: _Costs(window) for w in ("verify", "draft", "plain", "catch_up")}
        # the speculative parts at a batch size again, each over the plain step's cost there when it was kept (a
        # shared machine's speed swings by half between phases: a verify step kept in a fast one against plain steps
        # of a slow one read as a gain that was not there)
        self.rel = {w: _Costs(window) for w in ("verify", "draft")}
        self.why = ""
        self.hysteresis = 1.1  # the gain that turns it on at a batch size where it was off (costs drift)
        self._was_on: dict[int, bool] = {}
        self._last: dict[bool, str] = {}  # the kind of the last target step / draft call recorded
        self.probe_one = False  # the step speculates for one sequence only (`pick`): a probe of E
        self.probe_share = probe_share  # at B > 1, what probes may cost of the steps (`_probe_steps`)
        self._kind = False  # whether the probe state (interval, off steps) is that of B > 1; the other's kept
        self._t = 0  # decisions so far
        self.refresh = 64  # on at B > 1: plain steps at B are measured again after this many decisions without one
        self._plain_at: dict[int, int] = {}  # the decision count at each size's last plain step
        self._probes: dict[bool, tuple[int | None, int, int]] = {}
        # decided off at a batch size (not even full acceptance pays, or off at B > 1): its next steps,
        # up to this many and not past a probe or a verify, take that decision without working it out (working it
        # out costs a few per cent of a small model's step: docs/speculative.md)
        self.recheck = 32
        self._settled: tuple[int, int] | None = None  # (batch size, steps left) of such a decision

    @property
    def rates(self) -> list[float]:
        return self.accepted.rates

    def record(self, what: str, batch: int, seconds: float | None) -> None:
        """A measured decode-only step part: "verify" / "plain" (the whole target step, sampling and acceptance
        included) or "draft" / "catch_up" (the draft head after it, drafting or not), of `batch` sequences.
        `seconds` None: a step of that kind ran but is not one the policy weighs (a sequence drafted fewer than k,
        near its max_tokens: fewer rows than a speculative step has); it counts as the first after a switch."""
        target = what in ("verify", "plain")
        if what == "plain":
            self._plain_at[batch] = self._t
        switched = self._last.get(target) not in (None, what)
        self._last[target] = what
        costs = self.parts[what]
        if switched or seconds is None:  # the first step after a switch of kind is not kept either: it rebuilds
            costs.samples.setdefault(batch, deque(maxlen=costs.window))  # that kind's packs
            return
        if costs.add(batch, seconds) and what in self.rel and (off := self._off_step(batch)):
            self.rel[what].add(batch, seconds / off, first=True)  # (kept as the seconds were)

    def _off_step(self, batch: int) -> float | None:
        """plain + catch-up at `batch` from its own kept samples (None while plain has fewer than `least`)."""
        plain = self.cost("plain", batch, self.least)
        return None if plain is None else plain + (self.cost("catch_up", batch) or 0.0)

    def cost(self, what: str, batch: int, least: int = 1) -> float | None:
        """The mean of the kept samples at `batch` (less the largest), None while fewer than `least`."""
        return self.parts[what].mean(batch, least)

    def estimate(self, batch: int) -> tuple[float | None, float | None]:
        """(spec(B), plain(B)), None for a side with no measured step at any size yet. plain(B) from its curves;
        spec(B): where B's own verify and draft steps were kept against its plain steps, their ratios to those times'
        plain step (plain + catch-up at B) times B's now; else verify(B) + draft(B), each part from its own curve
        where a size within a quarter of B is measured, else from the sizes where both sides are: a verify step costs
        a plain one plus B times its draft rows' cost per sequence, and drafting costs a share of a plain step (both
        fitted over those sizes). Where no size has both, from a larger size's (an overestimate: it is measured on),
        else None (measured first)."""
        p = self.parts
        plain = p["plain"].at(batch)
        if plain is not None:
            plain += p["catch_up"].at(batch) or 0.0
        v, d = self.rel["verify"].mean(batch), self.rel["draft"].mean(batch)
        if v is not None and d is not None and (off := self._off_step(batch)):  # kept at B against its plain steps
            return (v + d) * off, plain  # of their time: the speed of the machine then and now cancels
        if p["verify"].near(batch, self.least) and p["draft"].near(batch, self.least) or plain is None:
            verify, draft = p["verify"].at(batch), p["draft"].at(batch)
            return (None if verify is None or draft is None else verify + draft), plain
        both = [b for b in p["verify"].sizes(self.least) if b in p["plain"].sizes(self.least)
                and b in p["draft"].sizes(self.least)]
        if not both:  # no size with both sides: a larger size's spec cost bounds B's, a smaller one's says nothing
            verify, draft = p["verify"], p["draft"]
            if 0 < batch <= min(max(verify.sizes(), default=0), max(draft.sizes(), default=0)):
                return verify.at(batch) + draft.at(batch), plain
            return None, plain
        # per sequence, the draft rows' cost and drafting's share of a plain step: fits over the measured sizes,
        # each weighted by its samples (a size seen twice in a batch's tail says little). A part with a sample kept
        # near B is read off its own curve: a fit from batch 1 rests on verify(1) - plain(1), a small difference of
        # two costs measured at different times, which a busy moment can turn into a gain well above 1
        known = {w: p[w].near(batch, 1) for w in ("verify", "draft")}
        n = {b: len(p["verify"].samples[b]) + len(p["plain"].samples[b]) for b in both}
        target = p["plain"].at(batch)
        if known["verify"]:
            verify = p["verify"].at(batch)
        else:
            rows = sum(n[b] * b * (p["verify"].mean(b) - p["plain"].mean(b)) for b in both) / sum(n[b] * b * b
                                                                                                  for b in both)
            verify = target + max(rows, 0.0) * batch
        if known["draft"]:
            return verify + p["draft"].at(batch), plain
        share = sum(n[b] * p["draft"].mean(b) for b in both) / sum(n[b] * p["plain"].mean(b) for b in both)
        return verify + share * target, plain

    def observe(self, drafted: int, accepted: int, seq: object = None) -> None:
        """One sequence's verify: `accepted` of its `drafted` drafts (`seq`: its id, for its own rates). The next
        decision is worked out anew (not a settled one)."""
        self._settled = None
        self.accepted.add(drafted, accepted)
        self.prior.add(drafted, accepted)
        if seq is not None:
            if seq not in self._seqs:  # the engine's prior, as if from 2 verifies: the first moves it by a third
                self._seqs[seq] = _Rates(self.seq_alpha, self.prior.rates, seen=2)
            self._seqs[seq].add(drafted, accepted)

    def expected_tokens(self, seqs: Sequence[object] = (), harmonic: bool = False) -> float:
        """E: tokens a sequence gets from one verify step: the mean over `seqs` of their own rates' (a sequence
        with no verify yet: the engine's prior), or the engine's; `harmonic`: their harmonic mean (the batch's
        steps per token, which its slow sequences rule)."""
        if not seqs:
            return self.accepted.expected(self.k)
        own = [self.prior.expected(self.k) if r is None else r.expected(self.k) for r in map(self._seqs.get, seqs)]
        # (E >= 1 each; statistics.harmonic_mean sums exactly, at a visible share of a small model's step)
        return len(own) / sum(1 / x for x in own) if harmonic else statistics.fmean(own)

    def forget(self, keep: Sequence[object]) -> None:
        """Drop the rates of sequences not in `keep` (finished ones)."""
        keep = set(keep)
        for s in [s for s in self._seqs if s not in keep]:
            del self._seqs[s]

    def speculate(self, batch: int, seqs: Sequence[object] = (), waiting: bool = False) -> bool:
        """Whether the step after this one speculates, for `batch` decoding sequences (`seqs`: their ids; `waiting`:
        requests wait for a slot). None decoding (prefill chunks only): no decision, nothing of the state moves (a
        probe interval runs on)."""
        self.probe_one = False
        if batch == 0:
            return False
        self._t += 1
        if (batch > 1) != self._kind:  # batch 1 and batches keep their own probe intervals
            self._probes[self._kind] = (self.interval, self.off_steps, self._every)
            self._kind = batch > 1
            self.interval, self.off_steps, self._every = self._probes.get(self._kind, (None, 0, 0))
        if self._settled is not None:
            if self._settled[0] == batch and self._settled[1] > 0:
                self._settled = (batch, self._settled[1] - 1)
                self.off_steps += 1
                return False
            self._settled = None
        if len(self._seqs) > 4 * max(batch, 8):
            self.forget(seqs)
        if self.always:
            return self._on("always")
        seen = self.accepted.seen[0] if self.accepted.seen else 0
        if not seen:
            return self._on("no verify yet")
        # at B > 1 with nothing waiting the batch runs as long as its slowest sequence (no request takes the slot of
        # one that finishes early): E is the harmonic mean of its sequences' (steps per token averaged: the slow ones
        # weigh as they do on the batch's length, and no one noisy estimate decides as the least's would); with
        # requests waiting, the mean
        e = self.expected_tokens(seqs, harmonic=batch > 1 and not waiting)
        if seen >= self.least_none and self.accepted.expected(self.k) < 1 + self.margin and e < 1 + self.margin:
            self._was_on[batch] = False
            # no step cost makes that pay; a probe costs a speculative step (and the resume of the draft ring's
            # window): probes come one in `base` steps, or fewer where that would cost over `probe_share` of them
            # (on a wide model a probe costs several plain steps)
            return self._off(max(self.base, self._probe_steps(batch)), why="next to nothing accepted", sooner=False,
                             later=True)
        spec, plain = self.estimate(batch)
        if spec is None or seen < self.least_seen:  # E from a few verifies is too rough to turn it off on
            return self._on("measuring a speculative step" if spec is None else "measuring E")
        if plain is None:
            return self._off(None, why="measuring a plain step")
        p = self.parts
        if batch > 1 and not p["plain"].near(batch, self.least):
            # plain(B) from other sizes is a line through them, and a step's fixed share makes a line from smaller
            # sizes overshoot a larger one's (the gain with it): at B > 1 plain steps (cheap, the off state) are
            # measured near B before anything turns on or probes there
            return self._off(None, why="measuring plain steps at this batch size")
        margin = self.slack(batch, waiting)
        gain = e * plain / ((1 + margin) * spec)
        sure = not 1 / self.band < gain < self.band
        spec_known = p["verify"].near(batch, self.least) and p["draft"].near(batch, self.least)
        # off at B > 1: on again only past the hysteresis (costs measured at different times drift on a shared box,
        # and a batch that flips pays for the sequences it puts apart)
        # a batch size seen first (a batch whose sequences finish apart) starts as the nearest size seen was
        if batch in self._was_on:
            was = self._was_on[batch]
        else:
            was = self._was_on[min(self._was_on, key=lambda b: abs(b - batch))] if self._was_on else True
        # on at B = 1: it stays on down to G = 1 / band (E, a running estimate, swings with the text - DSpark's drafts
        # pass or fail as a block - and an off step sees no acceptance but a probe's)
        self._was_on[batch] = gain >= ((1 / self.band if batch == 1 else 1) if was else
                                       (1 if batch == 1 else self.hysteresis))
        if self._was_on[batch] and not was and seqs and 2 * sum(s in self._seqs for s in seqs) < len(seqs):
            # on again at B > 1 on the batch's own acceptance, not the engine's (other texts' - the prior comes from
            # the verifies made, most of them where acceptance was high): until half its sequences have verified,
            # one of them verifies a step at the probe interval (each a probe's cost)
            self._was_on[batch] = False
            return self._off(self.interval or max(self.probe_every, self._probe_steps(batch)), sooner=False,
                             why=f"gain {gain:.2f}: the batch's own acceptance first")
        if self._was_on[batch]:
            if batch > 1 and self._t - self._plain_at.get(batch, self._t) > self.refresh:
                # on for long at B > 1: plain(B) is measured again (its samples are of another time, and a batch
                # that speculated has its sequences' positions apart), 3 plain steps, the first not kept
                self._plain_at[batch] = self._t
                p["plain"].samples.pop(batch, None)
                self._settled = (batch, 2)
                return self._off(None, why=f"gain {gain:.2f}: plain steps measured again")
            # a batch size with neither side measured: plain steps first (the cheap side to try, and the off state)
            if (sure and spec_known) or (p["plain"].near(batch, self.least) and p["catch_up"].near(batch, self.least)):
                return self._on(f"gain {gain:.2f}")
            return self._off(None, why=f"gain {gain:.2f} from estimates: measuring plain steps")
        if (self.k + 1) * plain < (1 + margin) * spec:  # decided off: the next few steps at B take it as it is
            self._settled = (batch, self.recheck - 1)
            return self._off(None, why=f"gain {gain:.2f}; not even full acceptance pays")
        if seqs and batch == 1 and seqs[0] not in self._seqs:
            return self._on(f"gain {gain:.2f}: a new sequence's first verify")
        # at B = 1 a probe loses about 1 - G of a step: probe more often the less it loses (one in 2 at G = 0.9, 8
        # at 0.6); a probe of a batch (one sequence's drafts, its resume) costs a share of a step whatever G is
        # (at B > 1 the interval, once set, only doubles: its first length is worked out once)
        every = min(max(2, round((1 - gain) / 0.05)), self.probe_every) if batch == 1 else \
            self.interval or max(self.probe_every, self._probe_steps(batch))
        if self._off(every, why=f"gain {gain:.2f}", sooner=batch == 1):
            return True
        if batch > 1:  # off at B > 1 (on again only past the hysteresis): the steps before the next probe take it as
            # it is (at most `recheck`; a verify works it out anew); a near tie - DSpark's batch 8 after batch 1's
            # verifies raised the engine's prior - worked it out every step, a visible share of a small model's step
            self._settled = (batch, min(self.recheck, self.interval - self.off_steps) - 1)
        return False

    def slack(self, batch: int, waiting: bool = True) -> float:
        """The margin at B with requests waiting (E the mean): margin * (1 + log2 B). A batch runs as long as its
        slowest sequence, and B sequences' accepted counts spread more the more there are, so a near tie per step
        loses over a batch. With nothing waiting the harmonic E weighs the slow sequences instead: `margin`."""
        return self.margin * (1 + math.log2(max(batch, 1))) if waiting else self.margin

    def pick(self, seqs: Sequence[object]) -> object:
        """The sequence a one-sequence probe drafts for: the one with the fewest verifies of its own."""
        return min(seqs, key=lambda s: self._seqs[s].seen[0] if s in self._seqs and self._seqs[s].seen else 0)

    def _on(self, why: str) -> bool:
        self.interval, self.off_steps, self.why = None, 0, why
        return True

    def _probe_steps(self, batch: int) -> int:
        """The steps per probe at which probing costs `probe_share` of them: a probe pays one sequence's draft rows
        and drafting beyond a plain step at B, about spec(1) - plain(1) (0 while that is unknown)."""
        spec1, plain1 = self.estimate(1)
        plain = self.parts["plain"].at(batch)
        if spec1 is None or plain1 is None or not plain:
            return 0
        return math.ceil(max(spec1 - plain1, 0.0) / (plain * self.probe_share))

    def _off(self, every: int | None, why: str, sooner: bool = True, later: bool = False) -> bool:
        """Off, but one step in `every` (None: never) probes E; the interval doubles with each probe that loses.
        `sooner`: a smaller `every` than the last (G nearer 1) restarts the interval from it; `later`: a larger
        `every` than the interval (a probe's cost measured since) raises it."""
        self.off_steps += 1
        self.why = why
        if every is None:
            return False
        if self.interval is None or sooner and every < self._every:  # probe sooner than the doubling says
            self.interval = every
        elif later and every > self.interval:
            self.interval = min(every, self.max_interval)
        self._every = every
        if self.off_steps >= self.interval:
            self.interval = min(2 * self.interval, self.max_interval)
            return self._probe(f"{why}: probing E")
        return False

    def _probe(self, why: str) -> bool:
        """On for one step, drafting for one sequence (`pick`); the probe interval is kept (it doubles on)."""
        self.off_steps, self.why, self.probe_one = 0, why, True
        return True
