"""The engine loop's draft call and the one place a speculative method picks its proposer (engine/model/proposer.py):
MTP (engine/model/mtp_proposer.py) or DSpark (engine/model/dspark_proposer.py)."""

from __future__ import annotations

import functools
from typing import Any

import torch

from engine.choices import Speculative
from engine.model.cache import KVCache, SeqStep
from engine.model.dspark_proposer import DSparkProposer
from engine.model.model import Transformer
from engine.model.mtp_proposer import MTPProposer
from engine.model.proposer import Proposer
from engine.speculative import DraftRequest


@functools.cache
def proposer_for(method: Any) -> Proposer | None:
    """The proposer of speculative method `method` (--speculative), None for none."""
    method = Speculative.parse(method, "speculative")
    if method is Speculative.MTP:
        return MTPProposer()
    if method is Speculative.DSPARK:
        return DSparkProposer()
    return None


def draft_for_requests(model: Transformer, cache: KVCache, config: Any, steps: list[SeqStep], hidden: torch.Tensor,
                       captured: torch.Tensor | None, requests: list[DraftRequest]) -> list[list[int]]:
    """The engine loop's draft call (engine/runner.py `ModelRunner.draft`): the configured proposer's `propose`."""
    if not requests:
        return []
    return proposer_for(config.spec.method).propose(model, cache, steps, hidden, captured, requests,
                                                    config.cache.block_size)
