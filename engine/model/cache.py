"""Decode-time state as fixed tensors, and the per-step plan.

Two kinds of storage per layer:
* fixed **slots** (one per running sequence): the sliding-window KV ring [S, win + spare, D] (position p at row
  p % (win + spare); under cp, a rank's share) and the compressor partial state [S, coff*m + spare, coff*D] fp32
  (token p's projections at row p % rows: a closing block reads its own m rows and, CSA, the previous block's;
  score rows hold gate logit + ape and start at -inf, which is how "no previous block" is expressed). `spare` is
  the number of speculative draft positions past the last accepted token (0 without speculation): both rings are
  indexed by position and are that much larger, so rolling rejected drafts back needs no state change at all -
  what they wrote is rewritten by real tokens before anything reads it, and nothing they wrote displaced a row a
  later query needs (engine/model/attention.py);
* a **KV pool** of `num_blocks` blocks of `block_size` token positions shared by all layers: a block holds
  block_size/m compressed entries of each compressed layer and, in CSA layers, as many indexer keys. A sequence
  owns a block table; compressed entry w of a layer with ratio m lives in block `table[w // (block_size/m)]`,
  row `w % (block_size/m)`. Block accounting is token arithmetic only (engine/kv_cache.py).

The plan of a step is built once and reused by every layer (FlashInfer's plan/run split).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from engine.config import ModelConfig


@dataclass
class LayerCache:
    ratio: int
    win_kv: torch.Tensor  # [S, win, D]
    cmp_kv: torch.Tensor | None = None  # [S, coff*m, coff*D] fp32
    cmp_score: torch.Tensor | None = None  # [S, coff*m, coff*D] fp32
    cmp_pool: torch.Tensor | None = None  # [NB, block_size/m, D]
    idx_kv: torch.Tensor | None = None  # [S, 2m, 2*Di] fp32 (CSA only)
    idx_score: torch.Tensor | None = None
    idx_pool: torch.Tensor | None = None  # [NB, block_size/m, Di]

    def reset_slot(self, slot: int) -> None:
        self.win_kv[slot].zero_()
        for st in (self.cmp_kv, self.idx_kv):
            if st is not None:
                st[slot].zero_()
        for st in (self.cmp_score, self.idx_score):
            if st is not None:
                st[slot].fill_(float("-inf"))


def ring_rows(win: int, cp: int, spare: int = 0) -> int:
    """Window-ring rows per rank: this rank's share of a window (win / cp) plus room for `spare` positions past the
    last accepted one (speculative drafts), so a rejected draft never overwrites a position a later query needs."""
    return win // cp + -(-spare // cp)


def _layer_spec(cfg: ModelConfig, m: int, num_slots: int, num_blocks: int, block_size: int, cp: int,
                dtype: torch.dtype, spare: int = 0) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Shapes and dtypes of one layer's tensors (compress ratio m)."""
    d, di, win = cfg.head_dim, cfg.index_head_dim, cfg.window_size
    spec = {"win_kv": ((num_slots, ring_rows(win, cp, spare), d), dtype)}
    if m:
        csa = ModelConfig.ratio_is_csa(m)
        coff = 2 if csa else 1
        spec["cmp_kv"] = spec["cmp_score"] = ((num_slots, coff * m + spare, coff * d), torch.float32)
        spec["cmp_pool"] = ((num_blocks, block_size // (m * cp), d), dtype)
        if csa:
            spec["idx_kv"] = spec["idx_score"] = ((num_slots, 2 * m + spare, 2 * di), torch.float32)
            spec["idx_pool"] = ((num_blocks, block_size // (m * cp), di), dtype)
    return spec


class KVCache:
    """All layers' state for `num_slots` sequences and a pool of `num_blocks` x `block_size` positions.

    Storage is a few **root tensors** per compress ratio, stacked over the layers of that ratio
    (`roots[m]["win_kv"]` is [L_m, S, win, D], ...); `layers[lid]` holds views into them. A compiled region takes
    the roots of its layer's ratio and slices its layer inside the graph (`layer_view`), instead of being passed
    every per-layer tensor. With `scratch=True` there is one extra slot (index num_slots) and one extra pool block
    (index num_blocks) that padded rows of a static-shape decode batch write to (engine/regions.py).
    """

    def __init__(self, cfg: ModelConfig, num_slots: int, num_blocks: int, block_size: int, dtype: torch.dtype,
                 layer_ids: list[int], cp: int = 1, device: torch.device | str = "cpu", scratch: bool = False,
                 spare: int = 0) -> None:
        """Under context parallelism (cp > 1) this holds one rank's share: win/cp ring rows and block_size/(m*cp)
        entries per block (engine/parallel.py). `spare`: draft positions past the last accepted token that the
        slot state must hold without displacing anything (speculative decoding; see the module docstring)."""
        for lid in layer_ids:
            m = cfg.compress_ratios[lid]
            if m and block_size % (m * cp):
                raise ValueError(f"block_size={block_size} is not a multiple of compress ratio {m} x cp {cp} "
                                 f"(layer {lid})")
        if cfg.window_size % cp:
            raise ValueError(f"window_size={cfg.window_size} is not divisible by cp={cp}")
        self.num_slots, self.num_blocks, self.block_size = num_slots, num_blocks, block_size
        self.scratch, self.spare = scratch, spare
        extra = 1 if scratch else 0
        by_ratio: dict[int, list[int]] = {}
        for lid in layer_ids:
            by_ratio.setdefault(cfg.compress_ratios[lid], []).append(lid)
        self.roots: dict[int, dict[str, torch.Tensor]] = {}
        self.where: dict[int, tuple[int, int]] = {}  # layer id -> (ratio, index in its ratio's roots)
        for m, lids in by_ratio.items():
            spec = _layer_spec(cfg, m, num_slots + extra, num_blocks + extra, block_size, cp, dtype, spare)
            roots = {}
            for name, (shape, dt) in spec.items():
                fill = float("-inf") if name.endswith("_score") else 0.0
                roots[name] = torch.full((len(lids), *shape), fill, dtype=dt, device=device)
            self.roots[m] = roots
            for i, lid in enumerate(lids):
                self.where[lid] = (m, i)
        self.layers: dict[int, LayerCache] = {lid: self.layer_view(lid, self.roots[self.where[lid][0]])
                                              for lid in layer_ids}

    def layer_view(self, lid: int, roots: dict[str, torch.Tensor]) -> LayerCache:
        """Layer `lid`'s tensors as views of `roots` (the roots of its ratio); cheap, so graphs call it inside."""
        m, i = self.where[lid]
        return LayerCache(ratio=m, **{name: t[i] for name, t in roots.items()})

    def reset_slot(self, slot: int) -> None:
        """Clear a slot's window ring and compressor states in every layer (the pool needs no reset: a sequence
        only reads entries it wrote). The slot index is a tensor, so on a graph backend one graph serves all slots."""
        idx = torch.tensor([slot], device=next(iter(self.roots.values()))["win_kv"].device)
        for roots in self.roots.values():
            for name, t in roots.items():
                if name.endswith("_pool"):
                    continue
                t.index_fill_(1, idx, float("-inf") if name.endswith("_score") else 0.0)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for roots in self.roots.values() for t in roots.values())


@dataclass
class SeqStep:
    """One sequence's share of a step: tokens [token_start, token_start + n) of the flat input are its positions
    [start, start + n)."""

    slot: int
    start: int
    n: int
    token_start: int
    block_table: torch.Tensor  # [num_blocks_of_seq] int64


@dataclass
class StepPlan:
    seqs: list[SeqStep]
    positions: torch.Tensor  # [T] int64
    block_size: int
    # decode group (sequences with one new token), batched: indices into the flat tokens, slots, positions, tables
    dec_tokens: torch.Tensor | None = None  # [B]
    dec_slots: torch.Tensor | None = None  # [B]
    dec_pos: torch.Tensor | None = None  # [B]
    dec_tables: torch.Tensor | None = None  # [B, max_blocks] (padded with 0; masked by position)
    prefill: tuple[SeqStep, ...] = ()

    @staticmethod
    def build(seqs: list[SeqStep], block_size: int, batch_decode: bool = True,
              device: torch.device | str = "cpu") -> StepPlan:
        """Index tensors of the step, built on the host and copied to `device` (prefill block tables too)."""
        positions = torch.cat([torch.arange(s.start, s.start + s.n) for s in seqs]).to(device)
        plan = StepPlan(seqs=seqs, positions=positions, block_size=block_size)
        dec = [s for s in seqs if s.n == 1] if batch_decode else []
        plan.prefill = tuple(dataclasses.replace(s, block_table=s.block_table.to(device))
                             for s in seqs if not (batch_decode and s.n == 1))
        if dec:
            plan.dec_tokens = torch.tensor([s.token_start for s in dec], device=device)
            plan.dec_slots = torch.tensor([s.slot for s in dec], device=device)
            plan.dec_pos = torch.tensor([s.start for s in dec], device=device)
            width = max(1, max(len(s.block_table) for s in dec))
            tables = torch.zeros(len(dec), width, dtype=torch.long)
            for i, s in enumerate(dec):
                tables[i, : len(s.block_table)] = s.block_table
            plan.dec_tables = tables.to(device)
        return plan
