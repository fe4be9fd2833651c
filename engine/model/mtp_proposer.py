"""The MTP proposer: speculative drafting with V4's MTP block (`mtp.0.*` of the preview checkpoints), behind the
`Proposer` seam (engine/model/proposer.py).

The MTP block (official `inference/model.py` `MTPBlock`; spec §2.7) maps the main model's last-layer streams at
position t and the token at t+1 to logits for the token at t+2. Drafting k tokens after a verify step (the way
vLLM's and SGLang's MTP proposers drive it; vLLM `deepseek_v4/nvidia/mtp.py` re-feeds the block's own output
streams, "the flat pre-hc_head residual", as the next step's hidden state):

1. **catch-up**: over every position whose target state is final this step - the positions the target just
   processed whose input tokens were accepted (a prefill chunk: all of them) - with the target's streams there and
   the next committed token (for the last one: the bonus token the target just sampled), the block's window KV is
   written at those positions; the last row's logits give draft 1 (the token after the bonus). A later query of the
   sliding-only block reads nothing of an earlier row but its ring row, so (one rank) the rows before the last in
   its window only write that (`mtp_fill_ring`: the kv of the block's input) and the last row runs the whole block;
   older rows of a long prefill chunk are read by no query and write nothing.
2. **recursion** (k > 1): draft j+1 comes from the block at the next position, fed its own output streams of the
   previous row and draft j. These rows write window KV at positions whose target state does not exist yet.

State of the MTP layer per sequence: its sliding-window KV ring (`KVCache.layers[n_layers]`, [win + spare,
head_dim] per slot, position p in row p % (win + spare); no compressor, no pool entries: compress ratio 0). The
catch-up writes the truth; the recursion's rows (positions last + 1 .. last + k - 1) are speculative and are left in
the ring: with spare = k rows past a window, the rows they overwrite held positions no later query sees, and a later
query reads one of their rows only once its position is final, after a catch-up (or `mtp_fill_ring`) rewrote it;
before that `_ring_valid` masks it as a position past the query's window. So rejected drafts need no MTP rollback,
as long as the next call's catch-up covers precisely the positions that became final (it rewrites the bonus
position, which the recursion had filled speculatively, with the target's state).
"""

from __future__ import annotations

import itertools
from typing import Any

import torch

from engine.model.cache import DraftInput, KVCache, SeqStep, StepPlan, write_ring
from engine.model.model import Transformer
from engine.model.proposer import Proposal, Sampler, greedy

__all__ = ["DraftInput", "MTPProposer", "Proposal", "mtp_catch_up", "mtp_fill_ring", "propose_mtp"]


def _table(s: DraftInput) -> torch.Tensor:
    """A DraftInput's block table as a tensor (the engine's proposer hands its list on: the one-call drafting
    reads no table, only a planned pass does)."""
    return torch.as_tensor(s.block_table, dtype=torch.long)


def _steps(seqs: list[DraftInput]) -> list[SeqStep]:
    out, t = [], 0
    for s in seqs:
        out.append(SeqStep(slot=s.slot, start=s.start, n=s.n, token_start=t, block_table=_table(s)))
        t += s.n
    return out


def _decode_rows(model: Transformer, cache: KVCache) -> int:
    """The catch-up's rows (1 + accepted drafts) as decode rows (StepPlan.build) where it may: one rank, the host."""
    return cache.spare + 1 if model.mtp[0].attn.par is None and model.embed.weight.device.type == "cpu" else 1


def _check_rows(seqs: list[DraftInput], hidden: torch.Tensor, next_ids: torch.Tensor) -> None:
    """hidden and next_ids hold one row per final position of `seqs`, back to back."""
    n = sum(s.n for s in seqs)
    if hidden.shape[0] != n or next_ids.shape[0] != n:
        raise ValueError(f"hidden {tuple(hidden.shape)} / next_ids {tuple(next_ids.shape)}: expected one row per "
                         f"final position ({n})")


def _catch_up_plan(model: Transformer, cache: KVCache, seqs: list[DraftInput], hidden: torch.Tensor,
                   next_ids: torch.Tensor, block_size: int) -> tuple[StepPlan, list[int]]:
    """The catch-up's step plan over the final positions of `seqs` and each sequence's last row in it."""
    _check_rows(seqs, hidden, next_ids)
    steps = _steps(seqs)
    plan = StepPlan.build(steps, block_size, device=hidden.device, decode_rows=_decode_rows(model, cache))
    return plan, [s.token_start + s.n - 1 for s in steps]


def _fills_ring(model: Transformer) -> bool:
    """Whether a catch-up writes only the ring rows of the positions before each sequence's last (`mtp_fill_ring`):
    one rank (a sharded block's catch-up runs whole, over every final position)."""
    return model.mtp[0].attn.par is None


def _fill_before(model: Transformer, cache: KVCache, seqs: list[DraftInput], hidden: torch.Tensor,
                 next_ids: torch.Tensor, through_last: bool) -> None:
    """The ring rows of each sequence's final positions in the window before its last (`through_last`: and the
    last's), by `mtp_fill_ring`: a later query of the sliding-only block reads nothing else of them (rows back to
    back, as `mtp_catch_up` takes them)."""
    win = model.mtp[0].attn.win
    rows: list[int] = []
    slots: list[int] = []
    pos: list[int] = []
    t = 0
    for s in seqs:
        first, end = max(s.start, s.last - win + 1), s.last + through_last
        rows.extend(range(t + first - s.start, t + end - s.start))
        slots.extend([s.slot] * (end - first))
        pos.extend(range(first, end))
        t += s.n
    if rows:
        dev = hidden.device
        at = torch.tensor(rows, device=dev)
        mtp_fill_ring(model, cache, torch.tensor(slots, device=dev), torch.tensor(pos, device=dev), hidden[at],
                      next_ids[at])


def mtp_catch_up(model: Transformer, cache: KVCache, seqs: list[DraftInput], hidden: torch.Tensor,
                 next_ids: torch.Tensor, block_size: int) -> None:
    """Write the MTP block's window KV at the final positions of `seqs` (rows back to back: hidden [T, n, dim] = the
    target's last-layer streams there, next_ids [T] = the committed token at each position + 1), for the sequences
    that draft nothing this step: their ring rows of the last window (`mtp_fill_ring`), or the whole block over
    every position on a sharded block."""
    _check_rows(seqs, hidden, next_ids)
    if _fills_ring(model):
        _fill_before(model, cache, seqs, hidden, next_ids.to(hidden.device), through_last=True)
        return
    plan, _ = _catch_up_plan(model, cache, seqs, hidden, next_ids, block_size)
    model.mtp_streams(hidden, next_ids.to(hidden.device), plan, cache)


def mtp_fill_ring(model: Transformer, cache: KVCache, slots: torch.Tensor, pos: torch.Tensor, hidden: torch.Tensor,
                  next_ids: torch.Tensor) -> None:
    """The MTP block's window-ring rows at positions `pos` [T] of `slots` [T] from the target's streams there
    (hidden [T, n, dim]) and the tokens after them (next_ids [T]), without the rest of the block: a ring row is the
    kv of its own position's block input (mHC collapse, attn_norm, wkv, kv_norm, RoPE), so this writes what a
    catch-up over those positions writes, for positions whose catch-up was put off (engine/runner.py `_resume`)."""
    blk = model.mtp[0]
    h, _, _ = blk.ops.hc_pre(model.mtp_input(hidden, next_ids), *blk.site_args("attn"))
    cos, sin = blk.attn.rope.cos_sin(pos)
    kv = blk.attn.kv(h, cos, sin)
    lc = cache.layers[blk.layer_id]
    write_ring(lc.win_store, slots, pos % lc.win_kv.shape[1], kv)


def propose_mtp(model: Transformer, cache: KVCache, seqs: list[DraftInput], hidden: torch.Tensor,
                next_ids: torch.Tensor, num_tokens: int, block_size: int,
                sample: Sampler = greedy) -> Proposal:
    """k = `num_tokens` MTP drafts for each sequence of `seqs`, after the target step that made their positions
    [start, start + n) final: catch-up (`mtp_catch_up`, persistent) then k - 1 recursive steps (speculative ring
    rows, masked until a catch-up rewrites them). See the module docstring."""
    if model.cfg.has_dspark or len(model.mtp) != 1:
        raise ValueError(f"MTP drafting needs exactly one MTP block, the model has {len(model.mtp)} draft layers"
                         + (" (DSpark stages)" if model.cfg.has_dspark else ""))
    if num_tokens < 1:
        raise ValueError(f"num_tokens={num_tokens}: draft at least one token")
    if cache.spare < num_tokens - 1:
        raise ValueError(f"{num_tokens} MTP drafts write {num_tokens - 1} positions past the last final one; the KV "
                         f"cache holds {cache.spare} (build it with spare >= num_speculative_tokens)")
    # the catch-up (persistent), its last rows' logits give draft 1; then the recursion (module docstring)
    _check_rows(seqs, hidden, next_ids)
    k = torch.full((len(seqs),), num_tokens, dtype=torch.long, device=hidden.device)
    if sample is greedy:
        fused = model.mtp_draft(hidden, next_ids.to(hidden.device), seqs, cache, num_tokens)  # all in one call
        if fused is not None:
            return Proposal(tokens=fused[1].t(), logits=fused[0].transpose(0, 1), num_proposed=k)
    next_ids = next_ids.to(hidden.device)
    if _fills_ring(model):  # the rows before each last write their ring rows only, then the last rows run whole
        _fill_before(model, cache, seqs, hidden, next_ids, through_last=False)
        ends = [t - 1 for t in itertools.accumulate(s.n for s in seqs)]  # each sequence's last row
        if ends != list(range(hidden.shape[0])):
            at = torch.tensor(ends, device=hidden.device)
            hidden, next_ids = hidden[at], next_ids[at]
        seqs = [DraftInput(s.slot, s.last, 1, s.block_table) for s in seqs]
    plan, last = _catch_up_plan(model, cache, seqs, hidden, next_ids, block_size)
    out, lg, tok = model.mtp_pass(hidden, next_ids, plan, cache, last)
    x = out if last == list(range(out.shape[0])) else out[torch.tensor(last, device=out.device)]
    logits, tokens = [lg], [tok if tok is not None and sample is greedy else sample(lg, 0)]
    every = list(range(len(seqs)))
    for j in range(1, num_tokens):
        steps = [SeqStep(slot=s.slot, start=s.last + j, n=1, token_start=i, block_table=_table(s))
                 for i, s in enumerate(seqs)]
        x, lg, tok = model.mtp_pass(x, tokens[-1], StepPlan.build(steps, block_size, device=x.device), cache, every)
        logits.append(lg)
        tokens.append(tok if tok is not None and sample is greedy else sample(lg, j))
    return Proposal(tokens=torch.stack(tokens, 1), logits=torch.stack(logits, 1), num_proposed=k)


class MTPProposer:
    """The MTP block as a `Proposer`: no captured context; the requests that want no drafts only catch up."""

    captures = False

    def propose(self, model: Transformer, cache: KVCache, steps: list[SeqStep], hidden: torch.Tensor,
                captured: torch.Tensor | None, requests: list, block_size: int) -> list[list[int]]:
        dev = hidden.device
        out: list[list[int]] = [[] for _ in requests]
        groups: tuple[list[int], list[int]] = ([], [])  # the requests that only catch up, those that draft
        for i, r in enumerate(requests):
            groups[r.want > 0].append(i)
        for idx, drafting in zip(groups, (False, True), strict=True):
            if not idx:
                continue
            rows = [steps[requests[i].entry].token_start + j for i in idx for j in range(requests[i].n)]
            first = rows[0] if rows else 0  # one run of rows back to back (one sequence's): a view, not a gather
            x = hidden[first:first + len(rows)] if rows == list(range(first, first + len(rows))) \
                else hidden[torch.tensor(rows, device=dev)]
            ids = torch.tensor([t for i in idx for t in requests[i].next_ids], dtype=torch.long, device=dev)
            seqs = [draft_input(requests[i]) for i in idx]
            if not drafting:
                mtp_catch_up(model, cache, seqs, x, ids, block_size)
                continue
            p = propose_mtp(model, cache, seqs, x, ids, max(requests[i].want for i in idx), block_size)
            for j, toks in zip(idx, p.tokens.tolist(), strict=True):
                out[j] = toks[: requests[j].want]
        return out


def draft_input(request: Any) -> DraftInput:
    """A DraftRequest's final positions as the draft heads take them (its block table the list it is: a tensor
    only where a planned pass reads it, `_table`)."""
    return DraftInput(slot=request.slot, start=request.start, n=request.n, block_table=request.block_table)
