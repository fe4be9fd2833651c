"""DeepSeek-V4 attention: q low-rank + per-head RMS, one shared K=V head, interleaved partial RoPE, sliding window,
the compressor and the lightning indexer (engine/model/compressor.py), the indexer's top-k, sinks, inverse RoPE on
the output and the grouped low-rank output projection.

Two paths over the same state, side by side (DeepSeek's naive/optimised `attn_impl` habit):
* `_chunk`: one sequence, any number of new tokens starting at any position (prefill, chunked prefill);
* `_decode`: many sequences, one new token each, vectorised over the batch.
Both call the same reference ops, and tests check that they agree.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from engine.config import ModelConfig
from engine.model.cache import (
    LayerCache,
    SeqStep,
    StepPlan,
    gather_entries,
    gather_pool,
    ring_keys,
    tap_ring,
    write_ring,
)
from engine.model.compressor import Compressor, Indexer
from engine.model.layers import Linear, RMSNorm, Rope, _empty
from engine.model.ops import OpsUser
from engine.parallel import Parallel
from engine.profiling import no_split
from nki_kernels.reference import desc_order, index_topk, sparse_attn_merge


def global_topk(cands: torch.Tensor, k: int, bitcast: bool = True) -> torch.Tensor:
    """Merge per-rank top-k candidates into the global top-k with the cp=1 order (score desc, then entry id asc).
    cands [..., R*K, 2] = (score, global id), -inf score for padding -> chosen ids [..., k] (-1 where none).
    Ordered by `desc_order` (ranks own distinct ids, so only padding rows tie, and they all give -1)."""
    sc, gid = cands[..., 0], cands[..., 1]
    pad = torch.isinf(sc)
    top = desc_order(sc, gid.masked_fill(pad, float(2 ** 24)).long(), k, bitcast)
    return gid.gather(-1, top).masked_fill(pad.gather(-1, top), -1).long()


def _picked(scores: torch.Tensor, pick: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """The entries `index_topk`'s `pick` (order, valid) keeps, as a mask shaped like `scores` [B, T, E]."""
    return torch.zeros(scores.shape, dtype=torch.bool, device=scores.device).scatter_(-1, pick[0], pick[1])


@functools.cache
def _ring_offsets(wl: int) -> torch.Tensor:
    """wl - i for the rows i of a window ring of `wl` rows (CPU, read-only): `Attention._ring_valid`'s one-rank form."""
    return wl - torch.arange(wl)


def floor_mod(a: torch.Tensor, m: int) -> torch.Tensor:
    """`a % m` of an int tensor with Python's sign rule (in [0, m) for m > 0, also for negative a), spelled with a
    floor division: `%` lowers to StableHLO `remainder`, which takes the dividend's sign (upstream torch-mlir), and
    the ring index's negative dividends there mask the wrong window rows (emulated on the host with torch.fmod:
    golden 10/12, |dlogit| up to 5.6)."""
    return a - torch.div(a, m, rounding_mode="floor") * m


# Prefill chunks on the host attend query tile by query tile over only the keys some query of the tile may see (a
# window of `win` positions before the tile plus the entries): a 2048-token chunk otherwise scores every query
# against all 2048 chunk positions + every entry, 90% of them masked (on V4-mid: 2.6x the prefill time). Exact: a
# masked key contributes exp(-inf) = 0, so dropping it changes only the summation order.
ATTN_Q_TILE = 128


def _tiles(g: _Group, cut: bool) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(q, keys, valid) of `g` in query tiles with the keys no query of the tile sees dropped (`cut`: the device
    takes data-dependent shapes cheaply); the whole group in one piece for decode groups (T = 1), short chunks, and
    where every new shape would be a new graph."""
    keys = g.keys.to(g.q.dtype)
    t = g.q.shape[1]
    if t <= ATTN_Q_TILE or not cut:
        return [(g.q, keys, g.valid)]
    out = []
    for t0 in range(0, t, ATTN_Q_TILE):
        valid = g.valid[:, t0: t0 + ATTN_Q_TILE]  # [B, t, N]
        cols = valid.any(1).any(0).nonzero().squeeze(-1)
        out.append((g.q[:, t0: t0 + ATTN_Q_TILE], keys[:, cols], valid[..., cols]))
    return out


@dataclass
class _Group:
    """One attention problem of a step: B sequences x T queries over this rank's keys."""

    rows: torch.Tensor | slice  # token rows of the step
    q: torch.Tensor  # [B, T, H, D]
    keys: torch.Tensor  # [B, N, D] window share, then entry share
    valid: torch.Tensor  # [B, T, N] causal + window (entries: causal only until the indexer picks)
    n_win: int = 0
    scores: torch.Tensor | None = None  # [B, T, E] indexer scores of this rank's entries (CSA)
    visible: torch.Tensor | None = None  # [B, T] global count of causal entries
    ids: torch.Tensor | None = None  # [E] global entry ids of this rank's entries

    def keep_entries(self, keep: torch.Tensor) -> None:
        """valid &= keep on the entry columns (keep [B, T, E]; window columns untouched). A new mask, not an
        in-place `valid[..., n_win:] &= keep`: open-ended slice assignment does not lower through upstream
        torch-mlir. Same values."""
        if self.n_win:
            keep = torch.cat([keep.new_ones(*keep.shape[:-1], self.n_win), keep], -1)
        self.valid = self.valid & keep


def index_selects(ratio: int, topk: int, last_pos: int) -> bool:
    """Whether an indexer's top-k can drop an entry for a query at position <= `last_pos`: only when more than `topk`
    compressed entries exist (all ranks together). Up to there the top-k keeps every causal entry, which is the mask
    attention applies anyway, so the indexer's queries, scores and selection change nothing and are skipped (exactly
    the same result; contexts up to index_topk x 4 tokens: 1024 on the mid bench model, 2048 x 4 on V4). The
    indexer's compressor still runs: its keys are needed once the context is longer."""
    return (last_pos + 1) // ratio > topk


class Attention(OpsUser, nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, par: Parallel | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.layer_id = layer_id
        self.ratio = cfg.compress_ratios[layer_id]
        self.n_heads, self.head_dim, self.rd = cfg.n_heads, cfg.head_dim, cfg.rope_head_dim
        self.win = cfg.window_size
        self.eps = cfg.norm_eps
        self.scale = cfg.head_dim ** -0.5
        self.par = par if par is not None and par.enabled else None
        self.rank, self.cp = (par.rank, par.cp) if self.par is not None else (0, 1)
        self.wq_a = Linear(cfg.dim, cfg.q_lora_rank)
        self.q_norm = RMSNorm(cfg.q_lora_rank)
        self.wq_b = Linear(cfg.q_lora_rank, cfg.n_heads * cfg.head_dim)
        self.wkv = Linear(cfg.dim, cfg.head_dim)
        self.kv_norm = RMSNorm(cfg.head_dim)
        self.wo_a = Linear(cfg.n_heads * cfg.head_dim // cfg.o_groups, cfg.o_groups * cfg.o_lora_rank)
        self.wo_b = Linear(cfg.o_groups * cfg.o_lora_rank, cfg.dim)
        self.attn_sink = _empty(cfg.n_heads)
        self.compressor = Compressor(cfg, self.ratio, cfg.head_dim, par) if self.ratio else None
        self.indexer = Indexer(cfg, par) if cfg.is_csa(layer_id) else None
        self.rope = Rope(cfg, compressed=bool(self.ratio))

    def _rope_tail(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        return self.ops.rope_tail(x, cos, sin, self.rd, inverse)

    def qkv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x [T, dim] -> q [T, H, D], kv [T, D], qr [T, q_lora]."""
        q, kv, qr = self.ops.attn_qkv(x, self.wq_a, self.q_norm.weight, self.wq_b, self.wkv, self.kv_norm.weight,
                                      cos, sin, self.n_heads, self.rd, self.eps)
        return q, self.ops.kv_quant(kv, self.rd), qr  # kv [T, D] (numerics: FP8 non-RoPE dims)

    def kv(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """`qkv`'s kv [T, D] alone (the same values: the query is not made)."""
        _, kv, _ = self.ops.attn_qkv(x, self.wq_a, self.q_norm.weight, self.wq_b, self.wkv, self.kv_norm.weight,
                                     cos, sin, self.n_heads, self.rd, self.eps, kv_only=True)
        return self.ops.kv_quant(kv, self.rd)

    def aux(self, x: torch.Tensor, qr: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
             index: bool = True) -> dict:
        """Compressor projections ("c", "i") and indexer queries/weights ("q") of all tokens (`index` False: no
        queries, see `index_needed`)."""
        aux = {}
        if self.ratio:
            aux["c"] = self.compressor.project(x)
            if self.indexer is not None:
                aux["i"] = self.indexer.compressor.project(x)
                if index:
                    aux["q"] = self.indexer.queries(x, qr, cos, sin)
        return aux

    def index_needed(self, last_pos: int) -> bool:
        """Whether this layer's indexer selects at `last_pos` (`index_selects`); False without an indexer."""
        return self.indexer is not None and index_selects(self.ratio, self.indexer.topk, last_pos)

    def _out(self, o: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Inverse RoPE, grouped wo_a: o [T, H, D] -> [T, G*o_lora]. wo_b comes with the mHC expand
        (`ops.attn_out_expand`, the fused `hc_attn_out` kernel in the kernel table)."""
        o = self._rope_tail(o, cos.unsqueeze(1), sin.unsqueeze(1), inverse=True)
        return self.ops.grouped_out_proj(o.reshape(o.shape[0], -1), self.wo_a.weight, self.cfg.o_groups)

    def forward(self, x: torch.Tensor, plan: StepPlan, cache: LayerCache) -> torch.Tensor:
        """x [T, dim] (attn_norm applied) -> [T, G*o_lora] (before wo_b)."""
        cos, sin = self.cos_sin(plan)  # [T, rd/2]
        q, kv, qr = self.qkv(x, cos, sin)
        aux = self.aux(x, qr, cos, sin, self.selects(plan))
        groups = []
        if plan.dec_tokens is not None:
            groups.append(self._decode(q, kv, aux, plan, cache))
        for s in plan.prefill:
            sl = slice(s.token_start, s.token_start + s.n)
            groups.append(self._chunk(q[sl], kv[sl], {k: tuple(v[sl] for v in val) for k, val in aux.items()}, s,
                                      cache, sl))
        if self.indexer is not None:
            self._select(groups)
        outs = self._attend(groups)
        if len(groups) == 1 and isinstance(groups[0].rows, slice) and groups[0].rows == slice(None):
            # a decode-only step: the group is every row
            return self._out(outs[0].flatten(0, 1), cos, sin)
        o = torch.empty_like(q)
        for g, og in zip(groups, outs, strict=True):
            o[g.rows] = og.flatten(0, 1)
        return self._out(o, cos, sin)

    def _select(self, groups: list[_Group]) -> None:
        """The indexer's causal top-k for every group; global across ranks with ONE all-gather per layer."""
        k = self.indexer.topk
        picks = []
        for g in groups:
            if g.scores is None:
                picks.append(None)
                continue
            nvis = (g.visible - self.rank).clamp(min=0).add(self.cp - 1).div(self.cp, rounding_mode="floor")
            picks.append(index_topk(g.scores, nvis, k, self.caps.bitcast))  # local order among this rank's entries
        if self.par is None:
            for g, p in zip(groups, picks, strict=True):
                if p is not None:
                    g.keep_entries(_picked(g.scores, p))
            return
        cands = []
        for g, p in zip(groups, picks, strict=True):
            if p is None:
                continue
            order, ok = p
            c = torch.stack([g.scores.gather(-1, order).masked_fill(~ok, float("-inf")), g.ids[order].float()], -1)
            if c.shape[-2] < k:  # same width on every rank
                c = torch.cat([c, c.new_full((*c.shape[:-2], k - c.shape[-2], 2), float("-inf"))], -2)
            cands.append(c.flatten(0, 1))  # [B*T, k, 2]
        if not cands:
            return
        key = f"L{self.layer_id}.index.topk"
        allc = torch.cat(self.par.all_gather(torch.cat(cands, 0), key), 1)  # [sum BT, cp*k, 2]
        chosen, off = global_topk(allc, k, self.caps.bitcast), 0
        for g in groups:
            if g.scores is None:
                continue
            b, tq, _ = g.scores.shape
            ch = chosen[off: off + b * tq].view(b, tq, 1, -1)
            off += b * tq
            g.keep_entries((g.ids.view(1, 1, -1, 1) == ch).any(-1))

    def _attend(self, groups: list[_Group]) -> list[torch.Tensor]:
        """Attention of every group over this rank's keys; under cp the shares are merged with ONE all-gather."""
        if self.par is None:
            cut, out = self.caps.data_dependent_shapes, []
            for g in groups:
                tiles = [self.ops.sparse_attn(q, k, v, self.attn_sink, self.scale) for q, k, v in _tiles(g, cut)]
                out.append(tiles[0] if len(tiles) == 1 else torch.cat(tiles, 1))
            return out
        packed = []
        for g in groups:
            parts = [self.ops.sparse_attn_partial(q, k, v, self.scale)
                     for q, k, v in _tiles(g, self.caps.data_dependent_shapes)]
            acc, mx, den = (torch.cat(t, 1) for t in zip(*parts, strict=True))
            packed.append(torch.cat([acc, mx.unsqueeze(-1), den.unsqueeze(-1)], -1).flatten(0, 1))  # [BT, H, D+2]
        gathered = self.par.all_gather(torch.cat(packed), f"L{self.layer_id}.attn.merge")
        parts = [(p[..., :-2], p[..., -2], p[..., -1]) for p in gathered]
        merged = sparse_attn_merge(parts, self.attn_sink)  # [sum BT, H, D]
        out, off = [], 0
        for g in groups:
            b, tq = g.q.shape[:2]
            out.append(merged[off: off + b * tq].view(b, tq, *merged.shape[1:]).to(g.q.dtype))
            off += b * tq
        return out

    def _owned(self, pos: torch.Tensor) -> torch.Tensor:
        return pos % self.cp == self.rank

    def _ring_valid(self, pos: torch.Tensor, wl: int) -> torch.Tensor:
        """[B, wl]: which of this rank's `wl` window-ring rows a query at pos [B] sees. Ring row i holds this rank's
        latest position p_i = rank + cp*j <= pos with j % wl == i (rows never written hold position < 0); the
        query sees it iff p_i >= 0 and p_i > pos - win (with spare rows for speculative drafts, the ring holds more
        than a window)."""
        cp = self.cp
        if cp == 1 and pos.is_cpu and not torch.compiler.is_compiling():
            # one rank on the host (every eager decode step): row i holds pos - d_i, d_i = (pos - i) mod wl, seen iff
            # d_i < win and d_i <= pos; the dividend kept non-negative, so `%` is the floor rule (see floor_mod)
            d = (pos[:, None] + _ring_offsets(wl)) % wl
            return (d < self.win) & (d <= pos[:, None])
        jmax = torch.div(pos - self.rank, cp, rounding_mode="floor")[:, None]  # [B, 1], >= -1
        j = jmax - floor_mod(jmax - torch.arange(wl, device=pos.device)[None], wl)
        p = self.rank + cp * j
        return (j >= 0) & (p > pos[:, None] - self.win)

    def _entry_ids(self, visible: torch.Tensor, num: int | None = None,
                   ) -> tuple[int, torch.Tensor, torch.Tensor] | None:
        """For queries with `visible` [B, T] causal entries: this rank's entry count, their global ids [E] and which
        of them each query sees [B, T, E]; None while no entry exists (a host sync where `num`, the most entries a
        query sees, is not given: the count sizes the gather)."""
        cp = self.cp
        num = int(visible.max()) if num is None else num  # entries that exist (all ranks)
        if num == 0:
            return None
        nloc = max(0, -(-(num - self.rank) // cp))  # this rank's share
        ids = self.rank + cp * torch.arange(nloc, device=visible.device)  # their global ids
        return nloc, ids, ids.view(1, 1, -1) < visible.unsqueeze(-1)

    def _entries(self, g: _Group, cache: LayerCache, tables: torch.Tensor, visible: torch.Tensor,
                 aux_q: tuple | None, found: tuple[int, torch.Tensor, torch.Tensor] | None) -> None:
        """Append this rank's compressed entries (and indexer scores) for queries with `visible` [B, T] entries;
        `found` = `_entry_ids(visible)` (a decode step makes it once for all layers)."""
        if found is None:
            return
        nloc, ids, seen = found
        entries = gather_entries(cache.cmp_store, tables, nloc)  # [B, E, D]
        g.n_win = g.keys.shape[1]
        g.keys = torch.cat([g.keys, entries.to(g.keys.dtype)], 1)
        g.valid = torch.cat([g.valid, seen], 2)
        if self.indexer is not None and aux_q is not None:
            ikeys = gather_entries(cache.idx_store, tables, nloc)  # [B, E, Di]
            g.scores = self.ops.index_score(aux_q[0], ikeys, aux_q[1])  # [B, T, E]
            g.visible, g.ids = visible, ids

    # -- static shapes: B sequences, one token each, in a compiled region ------------------------------------------
    def decode_static(self, x: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor, tables: torch.Tensor,
                      cache: LayerCache, split: Callable[[str], None] = no_split) -> torch.Tensor:
        """The decode path without host syncs or data-dependent shapes, for region graphs (engine/regions.py).

        x [B, dim] (attn_norm applied): row b is the token at pos[b] of the sequence in slots[b], with block table
        tables[b] [NB] (NB a static bucket). Padded rows point at the cache's scratch slot and block. Entries are
        gathered up to the bucket (NB * entries per block) and masked by position instead of cut at the longest
        sequence; writes that must not happen go to the scratch slot/block. Same math as `_decode` -> [B, G*o_lora]
        (before wo_b).
        `split(stage)` marks stage boundaries (a no-op unless region timing is on)."""
        cos, sin = self.rope.cos_sin(pos)  # [B, rd/2]
        q, kv, qr = self.qkv(x, cos, sin)
        aux = self.aux(x, qr, cos, sin)
        cp, wl = self.cp, cache.win_kv.shape[1]
        own = self._owned(pos)
        write_ring(cache.win_store, torch.where(own, slots, cache.win_kv.shape[0] - 1), (pos // cp) % wl, kv)
        keys = ring_keys(cache.win_store, slots)  # [B, wl, D]
        g = _Group(rows=slice(None), q=q[:, None], keys=keys, valid=self._ring_valid(pos, wl)[:, None])
        split("attn.qkv")
        if self.ratio:
            self.compressor.decode_static(*aux["c"], pos, slots, cache.cmp_kv, cache.cmp_score, cache.cmp_store,
                                          tables, self.rope, cache.dtype)
            if self.indexer is not None:
                self.indexer.compressor.decode_static(*aux["i"], pos, slots, cache.idx_kv, cache.idx_score,
                                                      cache.idx_store, tables, self.rope, cache.dtype)
            split("attn.compress")
            visible = ((pos + 1) // self.ratio)[:, None]  # [B, 1] global count of causal entries
            nloc = tables.shape[1] * cache.cmp_pool.shape[1]  # static: every entry the tables can hold
            ids = self.rank + cp * torch.arange(nloc, device=pos.device)  # [E] global ids
            g.n_win = wl
            g.keys = torch.cat([keys, gather_pool(cache.cmp_store, tables).to(keys.dtype)], 1)  # [B, wl + E, D]
            g.valid = torch.cat([g.valid, ids.view(1, 1, -1) < visible.unsqueeze(-1)], 2)
            if self.indexer is not None:
                ikeys = gather_pool(cache.idx_store, tables)  # [B, E, Di]
                g.scores = self.ops.index_score(aux["q"][0][:, None], ikeys, aux["q"][1][:, None])  # [B, 1, E]
                g.visible, g.ids = visible, ids
                self._select([g])
                split("attn.index")
        o = self._attend([g])[0][:, 0]  # [B, H, D]
        split("attn.core")
        out = self._out(o, cos, sin)
        split("attn.out")
        return out

    # -- one sequence ----------------------------------------------------------------------------------------------
    def _chunk(self, q: torch.Tensor, kv: torch.Tensor, aux: dict, s: SeqStep, cache: LayerCache,
               rows: slice) -> _Group:
        win, n, start, cp = self.win, s.n, s.start, self.cp
        wl = cache.win_kv.shape[1]  # ring rows on this rank (win / cp)
        qpos = torch.arange(start, start + n, device=q.device)
        # window keys: this rank's share of the win-1 earlier positions (from the ring), then of the chunk itself
        ppos = torch.arange(max(0, start - win + 1), start, device=q.device)
        ppos = ppos[self._owned(ppos)]
        own_new = self._owned(qpos)
        ring = cache.win_store
        keys = torch.cat([ring_keys(ring, s.slot, (ppos // cp) % wl), kv[own_new].to(ring.dtype)], 0)
        kpos = torch.cat([ppos, qpos[own_new]])
        valid = (kpos[None] <= qpos[:, None]) & (kpos[None] > qpos[:, None] - win)  # [n, Nw]
        tail = max(0, n - wl * cp)  # the last positions the ring holds (no negative slice start: XLA does not clamp)
        keep = qpos[tail:]
        keep_own = self._owned(keep)
        snap = cache.snap if s.snaps else None  # prefix caching: save the slot state at the boundaries passed
        if snap is not None:
            tap_ring(cache, s.slot, start, kv, s.snaps, win)  # before the ring write below overwrites older rows
        write_ring(cache.win_store, s.slot, (keep[keep_own] // cp) % wl, kv[tail:][keep_own])
        g = _Group(rows=rows, q=q[None], keys=keys[None], valid=valid[None])
        if self.ratio:
            taps = [(p, snap.cmp_kv[j], snap.cmp_score[j]) for p, j in s.snaps] \
                if snap is not None and snap.cmp_kv is not None else ()
            self.compressor.chunk(*aux["c"], start, cache.cmp_kv[s.slot], cache.cmp_score[s.slot], cache.cmp_store,
                                  s.block_table, self.rope, cache.dtype, taps)
            if self.indexer is not None:
                taps = [(p, snap.idx_kv[j], snap.idx_score[j]) for p, j in s.snaps] if taps else ()
                self.indexer.compressor.chunk(*aux["i"], start, cache.idx_kv[s.slot], cache.idx_score[s.slot],
                                              cache.idx_store, s.block_table, self.rope, cache.dtype, taps)
            aux_q = (aux["q"][0][None], aux["q"][1][None]) if "q" in aux else None
            visible = ((qpos + 1) // self.ratio)[None]
            self._entries(g, cache, s.block_table[None], visible, aux_q, self._entry_ids(visible))
        return g

    # -- many sequences, one token each ----------------------------------------------------------------------------
    def _decode(self, q: torch.Tensor, kv: torch.Tensor, aux: dict, plan: StepPlan, cache: LayerCache) -> _Group:
        ix = self.decode_writes(kv, aux, plan, cache)
        keys = ring_keys(cache.win_store, plan.dec_slots)  # [B, wl, D]
        g = _Group(rows=slice(None) if ix.all_rows else plan.dec_tokens, q=ix.pick(q)[:, None], keys=keys,
                   valid=ix.valid)
        if self.ratio:
            aux_q = None
            if self.indexer is not None and "q" in aux:
                aux_q = (ix.pick(aux["q"][0])[:, None], ix.pick(aux["q"][1])[:, None])
            visible, ids = self.step_entries(plan)
            self._entries(g, cache, plan.dec_tables, visible, aux_q, ids)
        return g

    def decode_writes(self, kv: torch.Tensor, aux: dict, plan: StepPlan, cache: LayerCache) -> _DecodeIndex:
        """The decode group's state writes (its kv into the window ring; each compressor's projections into its
        state, closing blocks pooled into entries) -> the step's `_DecodeIndex`."""
        slots = plan.dec_slots
        ix = self.decode_ix(plan, cache)
        w_slots, w_rows, w_tok = ix.ring_write
        write_ring(cache.win_store, w_slots, w_rows, kv if w_tok is None else kv[w_tok])
        if self.ratio:
            self.compressor.decode(*(ix.pick(t) for t in aux["c"]), slots, self.cmp_index(plan, cache.cmp_kv),
                                   cache.cmp_kv, cache.cmp_score, cache.cmp_store, cache.dtype)
            if self.indexer is not None:
                ic = self.indexer.compressor
                ic.decode(*(ix.pick(t) for t in aux["i"]), slots, self.cmp_index(plan, cache.idx_kv, ic),
                          cache.idx_kv, cache.idx_score, cache.idx_store, cache.dtype)
        return ix

    def decode_ix(self, plan: StepPlan, cache: LayerCache) -> _DecodeIndex:
        wl = cache.win_kv.shape[1]
        return plan.shared(("decode", wl, self.win, self.rank, self.cp), lambda: self._decode_index(plan, wl))

    def compressors(self) -> list[Compressor]:
        """The layer's compressors: the attention's, then the indexer's."""
        comps = [self.compressor] if self.ratio else []
        return comps + [self.indexer.compressor] if self.indexer is not None else comps

    def selects(self, plan: StepPlan) -> bool:
        """Whether the indexer's top-k drops entries in this step (`index_needed` at the step's last position)."""
        return self.index_needed(max(s.start + s.n - 1 for s in plan.seqs))

    def decode_picks(self, aux_q: tuple[torch.Tensor, torch.Tensor], cache: LayerCache, tables: torch.Tensor,
                     nloc: int, visible: torch.Tensor) -> torch.Tensor:
        """The indexer's picks among a decode group's `nloc` entries, [B, nloc] bool: `_entries` and `_select` of
        one rank for indexer queries aux_q ([B, Hi, Di], [B, Hi]) over the entries of `tables` [B, nb]."""
        ikeys = gather_entries(cache.idx_store, tables, nloc)  # [B, E, Di]
        scores = self.ops.index_score(aux_q[0][:, None], ikeys, aux_q[1][:, None])  # [B, 1, E]
        return _picked(scores, index_topk(scores, visible, self.indexer.topk, self.caps.bitcast))[:, 0]

    def cos_sin(self, plan: StepPlan) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE's cos / sin [T, rd/2] at the step's positions, made once a step for every layer of this table."""
        return plan.shared(("cos_sin", self.rope.key), lambda: self.rope.cos_sin(plan.positions))

    def step_entries(self, plan: StepPlan) -> tuple[torch.Tensor, tuple | None]:
        """`_visible` of the step's decode positions, made once a step for every layer of this ratio and rank."""
        last = max(plan.dec_list)  # the decode group's last position, known on the host
        return plan.shared(("entries", self.ratio, self.rank, self.cp), lambda: self._visible(plan.dec_pos, last))

    def _visible(self, pos: torch.Tensor, last: int | None = None) -> tuple[torch.Tensor, tuple | None]:
        """Causal entry counts [B, 1] of decode queries at `pos` [B] and their `_entry_ids` (`last`: max(pos), where
        the caller knows it)."""
        visible = ((pos + 1) // self.ratio)[:, None]
        return visible, self._entry_ids(visible, None if last is None else (last + 1) // self.ratio)

    def _decode_index(self, plan: StepPlan, wl: int) -> _DecodeIndex:
        """The step's decode-group indices for a window ring of `wl` rows (`_DecodeIndex`)."""
        tok, slots, pos = plan.dec_tokens, plan.dec_slots, plan.dec_pos
        all_rows = not plan.prefill and [s.token_start for s in plan.seqs] == list(range(len(plan.seqs)))
        own = None if self.cp == 1 else self._owned(pos)
        mine = own is None or bool(own.all())
        ring = (slots, (pos // self.cp) % wl, None if all_rows and mine else tok) if mine else \
            (slots[own], (pos[own] // self.cp) % wl, tok[own])
        return _DecodeIndex(all_rows, ring, self._ring_valid(pos, wl)[:, None], tok)

    def cmp_index(self, plan: StepPlan, state: torch.Tensor, comp: Compressor | None = None) -> tuple:
        """`Compressor.decode_index` of the step for `comp` (default: the attention's compressor) with `state`'s
        rows, made once for every layer of the same ratio and state size."""
        comp = comp or self.compressor
        rows = state.shape[1]
        return plan.shared(("compress", comp.ratio, rows, self.rope.key, self.rank, self.cp),
                           lambda: comp.decode_index(plan.dec_pos, plan.dec_slots, plan.dec_tables, rows, self.rope,
                                                     list(plan.dec_list)))


@dataclass
class _DecodeIndex:
    """What a decode step's attention derives from the plan alone, the same for every layer with the same ring
    (made once a step: `StepPlan.shared`)."""

    all_rows: bool  # the decode group is every token of the step, in order (no prefill): no row gather needed
    ring_write: tuple  # (slots, ring rows, token rows or None) of this rank's window-ring writes
    valid: torch.Tensor  # [B, 1, wl] the ring rows each query sees
    tokens: torch.Tensor  # [B] the decode group's token rows of the step

    def pick(self, t: torch.Tensor) -> torch.Tensor:
        """The decode group's rows of a per-token tensor of the step (t itself when the group is every row)."""
        return t if self.all_rows else t[self.tokens]
