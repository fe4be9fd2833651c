"""The engine loop's draft call: MTP (engine/model/draft.py) or DSpark (engine/model/dspark.py), by the config."""

from __future__ import annotations

from typing import Any

import torch

from engine.model.cache import KVCache, SeqStep
from engine.model.draft import DraftInput, mtp_catch_up, propose_mtp
from engine.model.dspark import propose_dspark, write_context
from engine.model.model import Transformer
from engine.speculative import DraftRequest


def draft_for_requests(model: Transformer, cache: KVCache, config: Any, steps: list[SeqStep], hidden: torch.Tensor,
                       captured: torch.Tensor | None, requests: list[DraftRequest]) -> list[list[int]]:
    """The engine loop's draft call (engine/runner.py `ModelRunner.draft`) after a step whose `steps` produced the
    target streams `hidden` [T, n, dim] (and, for DSpark, its `captured` context input): every request's final
    positions are caught up (MTP: the block over them; DSpark: their context keys) and the requests that want
    drafts get them (greedy: the draft head's argmax). Returns the drafted ids per request, at most `want` each."""
    if not requests:
        return []
    dev = hidden.device
    rows = [steps[r.entry].token_start + torch.arange(r.n) for r in requests]
    inputs = [DraftInput(slot=r.slot, start=r.start, n=r.n, block_table=torch.tensor(r.block_table, dtype=torch.long,
                                                                                      device=dev)) for r in requests]
    bs = config.cache.block_size
    if str(config.spec.method) == "dspark":
        if captured is None:
            raise RuntimeError("DSpark drafting needs the captured context of the target step")
        write_context(model, cache, inputs, captured[torch.cat(rows).to(dev)])
        want = [i for i, r in enumerate(requests) if r.want > 0]
        out: list[list[int]] = [[] for _ in requests]
        if want:
            p = propose_dspark(model, cache, torch.tensor([requests[i].slot for i in want]),
                               torch.tensor([inputs[i].last for i in want]),
                               torch.tensor([requests[i].next_ids[-1] for i in want]))
            keep = p.num_proposed.tolist()
            for j, i in enumerate(want):
                out[i] = p.tokens[j, : min(requests[i].want, keep[j])].tolist()
        return out
    out = [[] for _ in requests]
    groups = ([i for i, r in enumerate(requests) if r.want == 0], [i for i, r in enumerate(requests) if r.want > 0])
    for idx, drafting in zip(groups, (False, True), strict=True):
        if not idx:
            continue
        sel = torch.cat([rows[i] for i in idx]).to(dev)
        ids = torch.tensor([t for i in idx for t in requests[i].next_ids], dtype=torch.long, device=dev)
        seqs = [inputs[i] for i in idx]
        if not drafting:
            mtp_catch_up(model, cache, seqs, hidden[sel], ids, bs)
            continue
        p = propose_mtp(model, cache, seqs, hidden[sel], ids, max(requests[i].want for i in idx), bs)
        for j, i in enumerate(idx):
            out[i] = p.tokens[j, : requests[i].want].tolist()
    return out
