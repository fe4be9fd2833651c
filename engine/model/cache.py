"""Decode-time state (shared/spec/deepseek_v4.md §3) as fixed tensors, and the per-step plan.

Two kinds of storage per layer:
* fixed **slots** (one per running sequence): the sliding-window KV ring [S, win, D] (position p at row p % win)
  and the compressor partial state [S, coff*m, coff*D] fp32 (CSA: rows 0..m-1 = the previous complete block,
  rows m..2m-1 = the current block; HCA: rows 0..m-1 = the current block; score rows hold gate logit + ape and
  start at -inf, which is how "no previous block" is expressed);
* a **KV pool** of `num_blocks` blocks of `block_size` token positions shared by all layers: a block holds
  block_size/m compressed entries of each compressed layer and, in CSA layers, as many indexer keys. A sequence
  owns a block table; compressed entry w of a layer with ratio m lives in block `table[w // (block_size/m)]`,
  row `w % (block_size/m)`. Block accounting is token arithmetic only (engine/kv_cache.py).

The plan of a step is built once and reused by every layer (FlashInfer's plan/run split).
"""

from __future__ import annotations

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


class KVCache:
    """All layers' state for `num_slots` sequences and a pool of `num_blocks` x `block_size` positions."""

    def __init__(self, cfg: ModelConfig, num_slots: int, num_blocks: int, block_size: int, dtype: torch.dtype,
                 layer_ids: list[int], cp: int = 1, device: torch.device | str = "cpu") -> None:
        """Under context parallelism (cp > 1) this holds one rank's share: win/cp ring rows and block_size/(m*cp)
        entries per block (engine/parallel.py)."""
        for lid in layer_ids:
            m = cfg.compress_ratios[lid]
            if m and block_size % (m * cp):
                raise ValueError(f"block_size={block_size} is not a multiple of compress ratio {m} x cp {cp} "
                                 f"(layer {lid})")
        if cfg.window_size % cp:
            raise ValueError(f"window_size={cfg.window_size} is not divisible by cp={cp}")
        self.num_slots, self.num_blocks, self.block_size = num_slots, num_blocks, block_size
        d, di, win = cfg.head_dim, cfg.index_head_dim, cfg.window_size
        self.layers: dict[int, LayerCache] = {}
        for lid in layer_ids:
            m = cfg.compress_ratios[lid]
            lc = LayerCache(ratio=m, win_kv=torch.zeros(num_slots, win // cp, d, dtype=dtype, device=device))
            if m:
                coff = 2 if m == 4 else 1
                lc.cmp_kv = torch.zeros(num_slots, coff * m, coff * d, device=device)
                lc.cmp_score = torch.full((num_slots, coff * m, coff * d), float("-inf"), device=device)
                lc.cmp_pool = torch.zeros(num_blocks, block_size // (m * cp), d, dtype=dtype, device=device)
                if m == 4:
                    lc.idx_kv = torch.zeros(num_slots, 2 * m, 2 * di, device=device)
                    lc.idx_score = torch.full((num_slots, 2 * m, 2 * di), float("-inf"), device=device)
                    lc.idx_pool = torch.zeros(num_blocks, block_size // (m * cp), di, dtype=dtype, device=device)
            self.layers[lid] = lc

    def reset_slot(self, slot: int) -> None:
        for lc in self.layers.values():
            lc.reset_slot(slot)

    def nbytes(self) -> int:
        total = 0
        for lc in self.layers.values():
            for t in (lc.win_kv, lc.cmp_kv, lc.cmp_score, lc.cmp_pool, lc.idx_kv, lc.idx_score, lc.idx_pool):
                if t is not None:
                    total += t.numel() * t.element_size()
        return total


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
        positions = torch.cat([torch.arange(s.start, s.start + s.n) for s in seqs]).to(device)
        plan = StepPlan(seqs=seqs, positions=positions, block_size=block_size)
        dec = [s for s in seqs if s.n == 1] if batch_decode else []
        plan.prefill = tuple(s for s in seqs if not (batch_decode and s.n == 1))
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
