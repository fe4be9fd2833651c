"""The seam between the engine loop and a speculative method: a `Proposer` turns a target step's final streams
(and, where it asks for it, a context captured during that step) into drafts for a batch of requests; what every
proposer hands back per sequence is a `Proposal`. engine/model/drafting.py picks the method's proposer once."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from engine.model.cache import KVCache, SeqStep, StepPlan

# sample(logits [B, V] fp32, j) -> token ids [B]: how draft j (0-based) is drawn from its distribution.
Sampler = Callable[[torch.Tensor, int], torch.Tensor]


def greedy(logits: torch.Tensor, j: int = 0) -> torch.Tensor:
    """The greedy draft: argmax of each row."""
    return logits.argmax(-1)


@dataclass
class Proposal:
    """Drafts for B sequences: `tokens` [B, k] int64 (token j = position last + 2 + j); `logits` [B, k, vocab] fp32,
    the distribution each was drawn from (what rejection sampling divides by); `num_proposed` [B] int64, how many
    leading drafts to verify (DSpark's confidence truncation; k for MTP); `confidence` [B, k] fp32 raw logits of
    DSpark's confidence head (None for MTP)."""

    tokens: torch.Tensor
    logits: torch.Tensor
    num_proposed: torch.Tensor
    confidence: torch.Tensor | None = None


class Proposer(Protocol):
    """A speculative method's draft head, driven by the engine loop after every target step."""

    captures: bool  # whether the target step must capture a context for it (`hidden_and_capture`)

    def hidden_and_capture(self, model: Any, input_ids: torch.Tensor, plan: StepPlan,
                           cache: KVCache) -> tuple[torch.Tensor, Any]:
        """The target's last-layer streams [T, n, dim] and the context the proposer reads, made where it is read:
        an object with `rows(slice or row tensor)`, `cat(parts)` and `tensor()` -> [T, ...] (engine/model/
        dspark_proposer.py `Capture`; only called where `captures`)."""
        ...

    def propose(self, model: Any, cache: KVCache, steps: list[SeqStep], hidden: torch.Tensor,
                captured: torch.Tensor | None, requests: list[Any], block_size: int) -> list[list[int]]:
        """After a step whose `steps` produced the target streams `hidden` [T, n, dim] (and `captured`): catch the
        draft head's state up over every request's final positions and draft for the requests that want drafts
        (engine/speculative.py DraftRequest). Returns the drafted ids per request, at most `want` each."""
        ...
