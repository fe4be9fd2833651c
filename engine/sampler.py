"""Sampling: `SamplingParams` (per request), `Sampler` (one batched call per engine step) and `token_logprobs` (the
log-probabilities a request asked for, from the same fp32 logits rows).

Greedy (`temperature == 0`, or `top_k == 1`) is an exact argmax with the lowest index winning ties, so greedy output
through the scheduler can be compared token for token with the golden. Sampled rows apply temperature, then top-k,
then top-p on the renormalised top-k distribution (vLLM's order), and draw with inverse-CDF sampling from ONE
uniform per row taken from that request's own `torch.Generator`: a request's tokens depend only on its seed and its
logits, never on which other requests share the batch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples and when it stops (vLLM names and defaults)."""

    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 or -1 = off
    top_p: float = 1.0  # in (0, 1]; 1 = off
    seed: int | None = None  # per-request generator; None = drawn from the engine's seeded generator
    max_tokens: int = 16
    min_tokens: int = 0  # stop ids / EOS / stop strings are ignored until this many tokens were generated
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()  # stop strings, matched on the detokenised output (needs a tokenizer)
    ignore_eos: bool = False
    # vLLM's names: top-k logprobs of each generated token (0 = the token's own only; None = none), and of each
    # prompt token after the first (from the prefill logits at every prompt position).
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        # Normalise list / str inputs to tuples inside the constructor (the object is frozen afterwards).
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in (self.stop_token_ids or ())))
        if not isinstance(self.temperature, (int, float)) or not math.isfinite(self.temperature) \
                or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < -1:
            raise ValueError(f"top_k must be an int >= 1, or 0 / -1 to disable, got {self.top_k!r}")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise ValueError(f"seed must be an int or None, got {self.seed!r}")
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be an int in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative token ids, got {self.stop_token_ids!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be non-empty strings, got {self.stop!r}")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and (not isinstance(k, int) or isinstance(k, bool) or k < 0):
                raise ValueError(f"{name} must be an int >= 0 or None, got {k!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1


def make_generator(seed: int) -> torch.Generator:
    g = torch.Generator(device="cpu")
    g.manual_seed(seed)
    return g


class Sampler:
    """Batched sampling: one call per step for every sequence that produces a token this step."""

    def __call__(self, logits: torch.Tensor, params: Sequence[SamplingParams],
                 generators: Sequence[torch.Generator | None]) -> list[int]:
        """Sample one token per row.

        logits: [B, V] (any float dtype; computed in fp32). params, generators: one per row; a generator may be
        None only for greedy rows. Returns B token ids.
        """
        if logits.dim() != 2 or logits.shape[0] != len(params) or len(params) != len(generators):
            raise ValueError(f"logits {tuple(logits.shape)} must be [B, V] with B = len(params) = len(generators) "
                             f"({len(params)}, {len(generators)})")
        B = logits.shape[0]
        out = [0] * B
        greedy = [i for i, p in enumerate(params) if p.greedy]
        sampled = [i for i, p in enumerate(params) if not p.greedy]
        if greedy:
            # torch.argmax returns the first maximal index: lowest-index tie-break, exact.
            rows = logits if len(greedy) == B else logits[greedy]  # every row greedy: no gathered copy
            ids = rows.argmax(dim=-1).tolist()  # [Bg]
            for i, t in zip(greedy, ids, strict=True):
                out[i] = int(t)
        if sampled:
            ps = [params[i] for i in sampled]
            gens = [generators[i] for i in sampled]
            if any(g is None for g in gens):
                raise ValueError("a sampled (temperature > 0) row needs a torch.Generator")
            ids = _sample_rows(logits[sampled].float(), ps, gens)  # type: ignore[arg-type]
            for i, t in zip(sampled, ids, strict=True):
                out[i] = t
        return out


@dataclass(frozen=True)
class TokenLogprobs:
    """One position: the log-probability of its token (sampled, or given in the prompt) under the model's fp32
    logits (log-softmax, before temperature / top-k / top-p: vLLM's default `raw_logprobs`), the token's rank (1 =
    most likely) and the `k` most likely tokens with theirs, most likely first."""

    token_id: int
    logprob: float
    rank: int
    top: tuple[tuple[int, float], ...] = ()


def token_logprobs(logits: torch.Tensor, token_ids: Sequence[int], ks: Sequence[int]) -> list[TokenLogprobs]:
    """Log-probabilities of `token_ids[i]` under row i of `logits` [R, V] (computed in fp32), with the top `ks[i]`."""
    if logits.dim() != 2 or logits.shape[0] != len(token_ids) or len(token_ids) != len(ks):
        raise ValueError(f"logits {tuple(logits.shape)} must be [R, V] with R = len(token_ids) = len(ks) "
                         f"({len(token_ids)}, {len(ks)})")
    if not len(token_ids):
        return []
    lp = torch.log_softmax(logits.float(), dim=-1)  # [R, V]
    ids = torch.tensor(list(token_ids), dtype=torch.long)  # [R]
    chosen = lp.gather(1, ids[:, None])  # [R, 1]
    ranks = (lp > chosen).sum(dim=-1) + 1  # [R]
    kmax = min(max(ks), lp.shape[1])
    top_v, top_i = lp.topk(kmax, dim=-1) if kmax else (lp[:, :0], lp[:, :0].long())  # [R, kmax]
    top_v, top_i = top_v.tolist(), top_i.tolist()
    return [TokenLogprobs(int(t), float(c), int(r), tuple(zip(top_i[i][:k], top_v[i][:k], strict=True)))
            for i, (t, c, r, k) in enumerate(zip(token_ids, chosen[:, 0].tolist(), ranks.tolist(), ks, strict=True))]


def top_k_top_p_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> tuple[torch.Tensor, torch.Tensor]:
    """Temperature, top-k, top-p in the sorted domain.

    logits: [B, V] fp32. Returns (probs [B, V], index [B, V]): probabilities sorted descending (zero outside the
    kept set, rows sum to 1) and the vocabulary index of each column. Among equal logits the lower index comes
    first (and is kept first).
    """
    B, V = logits.shape
    temps = torch.tensor([p.temperature for p in params], dtype=torch.float32)  # [B]
    x = logits / temps[:, None]  # [B, V]
    ks = [p.top_k if 0 < p.top_k < V else V for p in params]
    # A full stable sort (not torch.topk, whose order among ties is unspecified): equal logits keep the lower
    # index first, so the kept set is deterministic.
    vals, idx = x.sort(dim=-1, descending=True, stable=True)  # [B, V]
    cols = torch.arange(vals.shape[1])  # [V]
    k_t = torch.tensor(ks)  # [B]
    vals = vals.masked_fill(cols[None, :] >= k_t[:, None], float("-inf"))  # [B, V]
    probs = torch.softmax(vals, dim=-1)  # [B, V]
    top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32)  # [B]
    if (top_p < 1).any():
        before = probs.cumsum(dim=-1) - probs  # [B, V] mass strictly before each column
        keep = before < top_p[:, None]  # [B, V] smallest prefix whose mass reaches p (first column always kept)
        keep[:, 0] = True
        probs = probs * keep  # [B, V]
        probs = probs / probs.sum(dim=-1, keepdim=True)  # [B, V]
    return probs, idx


def _sample_rows(logits: torch.Tensor, params: Sequence[SamplingParams],
                 generators: Sequence[torch.Generator]) -> list[int]:
    B, V = logits.shape
    u = torch.cat([torch.rand(1, generator=g) for g in generators])  # [B] in [0, 1), one per request generator
    if all(p.top_k <= 0 and p.top_p >= 1 for p in params):
        probs = torch.softmax(logits / torch.tensor([p.temperature for p in params])[:, None], dim=-1)  # [B, V]
        idx = None
    else:
        probs, idx = top_k_top_p_probs(logits, params)  # [B, V], [B, V]
    cdf = probs.cumsum(dim=-1)  # [B, V]
    target = u * cdf[:, -1]  # [B]
    pos = torch.searchsorted(cdf, target[:, None], right=True).squeeze(-1)  # [B]
    # Float slack: never step past the last column with non-zero mass.
    last = (probs > 0).long().cumsum(-1).argmax(-1)  # [B]
    pos = torch.minimum(pos, last)  # [B]
    tok = pos if idx is None else idx.gather(-1, pos[:, None]).squeeze(-1)  # [B]
    return [int(t) for t in tok.tolist()]
