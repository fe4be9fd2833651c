"""Attention and compressor over B sequences x C new tokens with static shapes: the multi-token step (prefill chunks,
speculative verify steps) as a compiled region graph (engine/regions.py `ChunkRegion`).

Sequence b processes positions [start_b, start_b + n_b) of slot slots_b, n_b <= C real tokens (C a static bucket); its
rows n_b..C-1 are padding, and so are whole padded sequences (n = 0, the scratch slot). Nothing depends on n_b or
start_b for a shape: every write that must not happen goes to the scratch slot / block, every read past what exists
is masked, and there is no host sync. Same math as the eager chunk path (`Attention._chunk`, `Compressor.chunk`),
which tests check; sequences never interact, so batching them is exact.

* **Window.** The ring as it was before the step (validity as in decode: ring row i holds this rank's latest
  position <= start - 1 in that row; it is seen iff it is inside the query's window) plus the chunk's own rows
  (causal, inside the window, this rank's positions). Queries run in static tiles of `ATTN_Q_TILE`; a tile's keys
  are the chunk rows of its window band [t0 - win + 1, t1) and, only while some query of the tile can still see a
  position before the chunk (t0 <= win - 2), the ring: C x C scores are never formed. Then the ring takes the last
  real rows (a position's row is (p // cp) % rows; earlier rows and padding write to the scratch slot).
* **Compressor.** The blocks that can close in C tokens, W = (m - 1 + C) // m, are gathered from (the state rows of
  the 2m (CSA) or m (HCA) positions before start || the chunk's projections) with computed indices; every one is
  pooled, those that do not close (or whose entry another cp rank owns) are written to the scratch block. The state
  keeps token p at row p % rows, so it is updated by position (the last `rows` real tokens).
* **Entries.** Every entry the block tables can hold (NB x entries per block, NB a static bucket), masked by the
  causal count per query; the indexer's top-k has a static k.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from engine.model.attention import ATTN_Q_TILE, _Group, floor_mod
from engine.model.cache import gather_pool, ring_keys, write_pool, write_ring
from engine.profiling import no_split

if TYPE_CHECKING:
    from engine.model.attention import Attention
    from engine.model.cache import LayerCache
    from engine.model.compressor import Compressor
    from engine.model.layers import Rope


def compressor_chunk(comp: Compressor, kv: torch.Tensor, score: torch.Tensor, start: torch.Tensor, n: torch.Tensor,
                     slots: torch.Tensor, st_kv: torch.Tensor, st_score: torch.Tensor, pool: torch.Tensor,
                     tables: torch.Tensor, rope: Rope, dtype: torch.dtype) -> None:
    """`Compressor.chunk` for B sequences with static shapes: kv/score [B, C, coff*D] (ape not added) at positions
    start[b] + [0, C), n[b] of them real; states [S, rows, coff*D] indexed by slots [B] (the last slot is scratch);
    tables [B, NB] (the pool's last block is scratch)."""
    m, rows = comp.ratio, st_kv.shape[1]
    b_, c = kv.shape[:2]
    dev = kv.device
    hist = (2 if comp.overlap else 1) * m  # positions before the chunk a closing block (and its predecessor) reads
    i = torch.arange(c, device=dev)
    pos = start[:, None] + i  # [B, C]
    score = score + comp.ape[pos % m]
    hrow = comp._state_rows(start[:, None] - hist + torch.arange(hist, device=dev), rows)  # [B, hist]
    s = slots[:, None]
    seq_kv = torch.cat([st_kv[s, hrow], kv], 1)  # [B, hist + C, coff*D]: element e is position start - hist + e
    seq_sc = torch.cat([st_score[s, hrow], score], 1)
    w_max = (m - 1 + c) // m
    blk = torch.arange(w_max, device=dev)
    first = hist - (start % m)[:, None] + blk * m  # [B, W] element of each block's first position
    cur = (first[..., None] + torch.arange(m, device=dev)).clamp(max=hist + c - 1).flatten(1)  # [B, W*m]
    bidx = torch.arange(b_, device=dev)[:, None]
    blocks_kv = seq_kv[bidx, cur].view(b_, w_max, m, -1)
    blocks_sc = seq_sc[bidx, cur].view(b_, w_max, m, -1)
    prev = (None, None)
    if comp.overlap:  # the block before the first one (its first-half channels), from the history
        before = first[:, :1] - m + torch.arange(m, device=dev)  # [B, m], >= 1
        prev = (seq_kv[bidx, before], seq_sc[bidx, before])
    pooled = comp.ops.compress_pool(blocks_kv, blocks_sc, comp.overlap, *prev)  # [B, W, D]
    w0 = torch.div(start, m, rounding_mode="floor")  # [B] the first block the chunk touches
    w = w0[:, None] + blk  # [B, W] entry ids
    closes = blk < (torch.div(start + n, m, rounding_mode="floor") - w0)[:, None]  # the first n_close blocks close
    entries = comp.finish(pooled.flatten(0, 1), torch.where(closes, w * m, 0).flatten(), rope, dtype)
    keep = closes & (w % comp.cp == comp.rank)
    u = torch.div(w, comp.cp, rounding_mode="floor")
    epb = pool.shape[1]
    bl = tables.gather(1, torch.div(u, epb, rounding_mode="floor").clamp(max=tables.shape[1] - 1))  # [B, W]
    write_pool(pool, torch.where(keep, bl, pool.shape[0] - 1).flatten(), (u % epb).flatten(), entries)
    # state by position: the last `rows` real tokens (distinct rows); the rest to the scratch slot
    real = (i < n[:, None]) & (i >= (n - rows)[:, None])
    srow = comp._state_rows(pos, rows)
    sslot = torch.where(real, s, st_kv.shape[0] - 1)
    st_kv[sslot, srow] = kv
    st_score[sslot, srow] = score


def _ring_valid(attn: Attention, start: torch.Tensor, qpos: torch.Tensor, wl: int) -> torch.Tensor:
    """[B, C, wl]: which ring rows (as they were before the step: positions <= start - 1) each query qpos [B, C]
    sees. As `Attention._ring_valid` with the latest position start - 1 and each query's own window."""
    cp = attn.cp
    jmax = torch.div(start - 1 - attn.rank, cp, rounding_mode="floor")[:, None]  # [B, 1], >= -1
    j = jmax - floor_mod(jmax - torch.arange(wl, device=start.device)[None], wl)  # [B, wl]
    p = attn.rank + cp * j
    return (j >= 0)[:, None] & (p[:, None] > qpos[..., None] - attn.win)


def attention_chunk(attn: Attention, x: torch.Tensor, start: torch.Tensor, n: torch.Tensor, slots: torch.Tensor,
                    tables: torch.Tensor, cache: LayerCache, split: Callable[[str], None] = no_split) -> torch.Tensor:
    """x [B*C, dim] (attn_norm applied; rows b*C + i = position start[b] + i of the sequence in slots[b], real for
    i < n[b]), tables [B, NB] -> [B*C, G*o_lora] (before wo_b). Padded sequences: n = 0, the scratch slot."""
    b_ = start.shape[0]
    c = x.shape[0] // b_
    dev = x.device
    win, cp, wl = attn.win, attn.cp, cache.win_kv.shape[1]
    i = torch.arange(c, device=dev)
    qpos = start[:, None] + i  # [B, C]
    cos, sin = attn.rope.cos_sin(qpos.flatten())
    q, kv, qr = attn.qkv(x, cos, sin)
    aux = attn.aux(x, qr, cos, sin)
    q, kv = q.view(b_, c, *q.shape[1:]), kv.view(b_, c, -1)
    ring = ring_keys(cache.win_store, slots)  # [B, wl, D], before this step's writes
    ring_ok = _ring_valid(attn, start, qpos, wl)  # [B, C, wl]
    own = qpos % cp == attn.rank  # [B, C]
    real = i < n[:, None]
    keep = own & real & (i >= (n - wl * cp)[:, None])  # the positions the ring holds after the step
    write_ring(cache.win_store, torch.where(keep, slots[:, None], cache.win_kv.shape[0] - 1),
               torch.div(qpos, cp, rounding_mode="floor") % wl, kv)
    split("attn.qkv")
    ents = visible = ids = ikeys = None
    if attn.ratio:
        ckv, csc = aux["c"]
        compressor_chunk(attn.compressor, ckv.view(b_, c, -1), csc.view(b_, c, -1), start, n, slots,
                         cache.cmp_kv, cache.cmp_score, cache.cmp_store, tables, attn.rope, cache.dtype)
        if attn.indexer is not None:
            ikv, isc = aux["i"]
            compressor_chunk(attn.indexer.compressor, ikv.view(b_, c, -1), isc.view(b_, c, -1), start, n, slots,
                             cache.idx_kv, cache.idx_score, cache.idx_store, tables, attn.rope, cache.dtype)
            ikeys = gather_pool(cache.idx_store, tables)  # [B, E, Di]
        split("attn.compress")
        visible = torch.div(qpos + 1, attn.ratio, rounding_mode="floor")  # [B, C] global count of causal entries
        nloc = tables.shape[1] * cache.cmp_pool.shape[1]  # static: every entry the tables can hold
        ids = attn.rank + cp * torch.arange(nloc, device=dev)  # [E] global ids
        ents = gather_pool(cache.cmp_store, tables).to(ring.dtype)  # [B, E, D]
    chunk_keys = kv.to(ring.dtype)
    groups = []
    for t0 in range(0, c, ATTN_Q_TILE):
        t1 = min(c, t0 + ATTN_Q_TILE)
        lo = max(0, t0 - win + 1)  # the tile's window band of chunk rows
        ti, kj = i[t0:t1, None], i[None, lo:t1]
        band_ok = (kj <= ti) & (ti - kj < win) & own[:, None, lo:t1]  # [B, T, band]
        keys, valid = [chunk_keys[:, lo:t1]], [band_ok]
        if t0 <= win - 2:  # some query of the tile still sees positions before the chunk
            keys, valid = [ring, *keys], [ring_ok[:, t0:t1], *valid]
        g = _Group(rows=slice(t0, t1), q=q[:, t0:t1], keys=torch.cat(keys, 1), valid=torch.cat(valid, 2))
        if ents is not None:
            g.n_win = g.keys.shape[1]
            g.keys = torch.cat([g.keys, ents], 1)
            g.valid = torch.cat([g.valid, ids.view(1, 1, -1) < visible[:, t0:t1, None]], 2)
            if ikeys is not None:
                qi, wi = aux["q"]
                qi, wi = qi.view(b_, c, *qi.shape[1:]), wi.view(b_, c, -1)
                g.scores = attn.ops.index_score(qi[:, t0:t1], ikeys, wi[:, t0:t1])  # [B, T, E]
                g.visible, g.ids = visible[:, t0:t1], ids
        groups.append(g)
    if attn.indexer is not None:
        attn._select(groups)
        split("attn.index")
    o = torch.cat(attn._attend(groups), 1)  # [B, C, H, D]
    split("attn.core")
    out = attn._out(o.flatten(0, 1), cos, sin)
    split("attn.out")
    return out
