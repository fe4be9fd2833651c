"""DeepSeek-V4 attention: q low-rank + per-head RMS, one shared K=V head, interleaved partial RoPE, sliding window,
the compressor (CSA overlapping m=4 / HCA non-overlapping), the lightning indexer, sinks, inverse RoPE on the output
and the grouped low-rank output projection (shared/spec/deepseek_v4.md §2.3-2.5, state §3).

Two paths over the same state, side by side (DeepSeek's naive/optimised `attn_impl` habit):
* `_chunk`: one sequence, any number of new tokens starting at any position (prefill, chunked prefill);
* `_decode`: many sequences, one new token each, vectorised over the batch.
Both call the same reference ops, and tests check that they agree.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.config import ModelConfig
from engine.model.cache import LayerCache, SeqStep, StepPlan
from engine.model.layers import Linear, RMSNorm, Rope, _empty
from nki_kernels.reference import (
    compress_pool,
    grouped_out_proj,
    index_score,
    index_topk,
    linear,
    rms_norm,
    rope_apply,
    sparse_attn,
)


class Compressor(nn.Module):
    """Gated pooling of m consecutive tokens into one entry; CSA (m=4) overlaps with the previous block (coff=2)."""

    def __init__(self, cfg: ModelConfig, ratio: int, head_dim: int) -> None:
        super().__init__()
        self.ratio, self.head_dim, self.overlap = ratio, head_dim, ratio == 4
        coff = 2 if self.overlap else 1
        self.wkv = Linear(cfg.dim, coff * head_dim)
        self.wgate = Linear(cfg.dim, coff * head_dim)
        self.ape = _empty(ratio, coff * head_dim)
        self.norm = RMSNorm(head_dim)
        self.eps = cfg.norm_eps
        self.rd = cfg.rope_head_dim

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 projections of all tokens: x [T, dim] -> kv, score [T, coff*D] (ape not yet added)."""
        xf = x.float()
        return linear(xf, self.wkv.weight), linear(xf, self.wgate.weight)

    def finish(self, pooled: torch.Tensor, first_pos: torch.Tensor, rope: Rope, dtype: torch.dtype) -> torch.Tensor:
        """RMSNorm, then RoPE of the trailing dims at the position of the block's first token. [W, D] -> [W, D]."""
        e = rms_norm(pooled, self.norm.weight, self.eps)
        cos, sin = rope.cos_sin(first_pos)
        e = torch.cat([e[..., : -self.rd], rope_apply(e[..., -self.rd:], cos, sin)], dim=-1)
        return e.to(dtype)

    # -- one sequence, n new tokens --------------------------------------------------------------------------------
    def chunk(self, kv: torch.Tensor, score: torch.Tensor, start: int, st_kv: torch.Tensor, st_score: torch.Tensor,
              pool: torch.Tensor, table: torch.Tensor, rope: Rope, dtype: torch.dtype) -> None:
        """Feed tokens at positions [start, start+n) (kv/score [n, coff*D], ape not added) through the slot state
        `st_kv/st_score` [coff*m, coff*D]; every block that closes becomes an entry written to `pool` via `table`."""
        m, n = self.ratio, kv.shape[0]
        off = m if self.overlap else 0
        r0 = start % m  # rows of the current block already in the state
        pos = torch.arange(start, start + n)
        score = score + self.ape[pos % m]
        seq_kv = torch.cat([st_kv[off: off + r0], kv], 0)  # positions start-r0 .. start+n-1
        seq_sc = torch.cat([st_score[off: off + r0], score], 0)
        n_close = (start + n) // m - start // m
        if n_close:
            blocks_kv = seq_kv[: n_close * m].view(n_close, m, -1)
            blocks_sc = seq_sc[: n_close * m].view(n_close, m, -1)
            prev = (st_kv[:m], st_score[:m]) if self.overlap else (None, None)
            pooled = compress_pool(blocks_kv, blocks_sc, self.overlap, *prev)  # [W, D]
            w = torch.arange(start // m, start // m + n_close)
            entries = self.finish(pooled, w * m, rope, dtype)
            epb = pool.shape[1]
            pool[table[w // epb], w % epb] = entries
            if self.overlap:
                st_kv[:m] = blocks_kv[-1]
                st_score[:m] = blocks_sc[-1]
        rest = seq_kv.shape[0] - n_close * m
        st_kv[off: off + rest] = seq_kv[n_close * m:]
        st_score[off: off + rest] = seq_sc[n_close * m:]

    # -- B sequences, one new token each ---------------------------------------------------------------------------
    def decode(self, kv: torch.Tensor, score: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor,
               st_kv: torch.Tensor, st_score: torch.Tensor, pool: torch.Tensor, tables: torch.Tensor, rope: Rope,
               dtype: torch.dtype) -> None:
        """kv/score [B, coff*D] at positions pos [B]; states [S, coff*m, coff*D] indexed by slots [B]."""
        m = self.ratio
        off = m if self.overlap else 0
        row = off + pos % m
        st_kv[slots, row] = kv
        st_score[slots, row] = score + self.ape[pos % m]
        closing = ((pos + 1) % m == 0).nonzero().flatten()
        if closing.numel() == 0:
            return
        cs = slots[closing]
        skv, ssc = st_kv[cs], st_score[cs]  # [C, coff*m, coff*D]
        if self.overlap:
            pooled = compress_pool(skv[:, None, m:], ssc[:, None, m:], True, skv[:, :m], ssc[:, :m])[:, 0]  # [C, D]
            st_kv[cs, :m] = skv[:, m:]
            st_score[cs, :m] = ssc[:, m:]
        else:
            pooled = compress_pool(skv, ssc, False)  # [C, D]
        w = pos[closing] // m
        entries = self.finish(pooled, w * m, rope, dtype)
        epb = pool.shape[1]
        pool[tables[closing, w // epb], w % epb] = entries


class Indexer(nn.Module):
    """Lightning indexer (CSA layers): its own CSA compressor at index_head_dim, scores with ReLU and head weights,
    causal top-k of the compressed entries per query."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.head_dim, self.topk = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk
        self.wq_b = Linear(cfg.q_lora_rank, cfg.index_n_heads * cfg.index_head_dim)
        self.weights_proj = Linear(cfg.dim, cfg.index_n_heads)
        self.compressor = Compressor(cfg, 4, cfg.index_head_dim)
        self.rd = cfg.rope_head_dim
        self.weight_scale = cfg.index_head_dim ** -0.5 * cfg.index_n_heads ** -0.5

    def queries(self, x: torch.Tensor, qr: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, Hi, Di] (RoPE on the trailing dims, no per-head norm) and head weights [T, Hi] fp32."""
        q = linear(qr, self.wq_b.weight).view(qr.shape[0], self.n_heads, self.head_dim)
        q = torch.cat([q[..., : -self.rd], rope_apply(q[..., -self.rd:], cos.unsqueeze(1), sin.unsqueeze(1))], -1)
        w = linear(x, self.weights_proj.weight).float() * self.weight_scale
        return q, w


def gather_entries(pool: torch.Tensor, tables: torch.Tensor, num: int) -> torch.Tensor:
    """Entries 0..num-1 of each sequence: pool [NB, epb, D], tables [B, max_blocks] -> [B, num, D]."""
    epb = pool.shape[1]
    nblk = -(-num // epb)
    return pool[tables[:, :nblk]].flatten(1, 2)[:, :num]


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.layer_id = layer_id
        self.ratio = cfg.compress_ratios[layer_id]
        self.n_heads, self.head_dim, self.rd = cfg.n_heads, cfg.head_dim, cfg.rope_head_dim
        self.win = cfg.window_size
        self.eps = cfg.norm_eps
        self.scale = cfg.head_dim ** -0.5
        self.wq_a = Linear(cfg.dim, cfg.q_lora_rank)
        self.q_norm = RMSNorm(cfg.q_lora_rank)
        self.wq_b = Linear(cfg.q_lora_rank, cfg.n_heads * cfg.head_dim)
        self.wkv = Linear(cfg.dim, cfg.head_dim)
        self.kv_norm = RMSNorm(cfg.head_dim)
        self.wo_a = Linear(cfg.n_heads * cfg.head_dim // cfg.o_groups, cfg.o_groups * cfg.o_lora_rank)
        self.wo_b = Linear(cfg.o_groups * cfg.o_lora_rank, cfg.dim)
        self.attn_sink = _empty(cfg.n_heads)
        if self.ratio:
            self.compressor = Compressor(cfg, self.ratio, cfg.head_dim)
            self.indexer = Indexer(cfg) if self.ratio == 4 else None
        self.rope = Rope(cfg, compressed=bool(self.ratio))

    def _rope_tail(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        return torch.cat([x[..., : -self.rd], rope_apply(x[..., -self.rd:], cos, sin, inverse)], dim=-1)

    def forward(self, x: torch.Tensor, plan: StepPlan, cache: LayerCache) -> torch.Tensor:
        """x [T, dim] (attn_norm applied) -> [T, dim]."""
        t = x.shape[0]
        cos, sin = self.rope.cos_sin(plan.positions)  # [T, rd/2]
        qr = rms_norm(linear(x, self.wq_a.weight), self.q_norm.weight, self.eps)  # [T, q_lora]
        q = linear(qr, self.wq_b.weight).view(t, self.n_heads, self.head_dim)
        q = rms_norm(q, None, self.eps)  # per-head unweighted RMS
        q = self._rope_tail(q, cos.unsqueeze(1), sin.unsqueeze(1))  # [T, H, D]
        kv = rms_norm(linear(x, self.wkv.weight), self.kv_norm.weight, self.eps)
        kv = self._rope_tail(kv, cos, sin)  # [T, D]
        aux = {}
        if self.ratio:
            aux["c"] = self.compressor.project(x)
            if self.indexer is not None:
                aux["i"] = self.indexer.compressor.project(x)
                aux["q"] = self.indexer.queries(x, qr, cos, sin)
        o = torch.empty_like(q)
        if plan.dec_tokens is not None:
            o[plan.dec_tokens] = self._decode(q, kv, aux, plan, cache)
        for s in plan.prefill:
            sl = slice(s.token_start, s.token_start + s.n)
            o[sl] = self._chunk(q[sl], kv[sl], {k: tuple(v[sl] for v in val) for k, val in aux.items()}, s, cache)
        o = self._rope_tail(o, cos.unsqueeze(1), sin.unsqueeze(1), inverse=True)
        o = grouped_out_proj(o.reshape(t, -1), self.wo_a.weight, self.cfg.o_groups)
        return linear(o, self.wo_b.weight)

    # -- one sequence ----------------------------------------------------------------------------------------------
    def _chunk(self, q: torch.Tensor, kv: torch.Tensor, aux: dict, s: SeqStep, cache: LayerCache) -> torch.Tensor:
        win, n, start = self.win, s.n, s.start
        qpos = torch.arange(start, start + n)
        # window keys: up to win-1 earlier positions from the ring, then the chunk itself
        ppos = torch.arange(max(0, start - win + 1), start)
        keys = torch.cat([cache.win_kv[s.slot, ppos % win], kv.to(cache.win_kv.dtype)], 0)
        kpos = torch.cat([ppos, qpos])
        valid = (kpos[None] <= qpos[:, None]) & (kpos[None] > qpos[:, None] - win)  # [n, Nw]
        keep = qpos[-win:]
        cache.win_kv[s.slot, keep % win] = kv[-win:].to(cache.win_kv.dtype)
        if self.ratio:
            m = self.ratio
            c = self.compressor
            c.chunk(*aux["c"], start, cache.cmp_kv[s.slot], cache.cmp_score[s.slot], cache.cmp_pool,
                    s.block_table, self.rope, cache.cmp_pool.dtype)
            if self.indexer is not None:
                self.indexer.compressor.chunk(*aux["i"], start, cache.idx_kv[s.slot], cache.idx_score[s.slot],
                                              cache.idx_pool, s.block_table, self.rope, cache.idx_pool.dtype)
            num = (start + n) // m
            if num:
                entries = gather_entries(cache.cmp_pool, s.block_table[None], num)[0]  # [E, D]
                visible = (qpos + 1) // m  # [n]
                sel = torch.arange(num)[None] < visible[:, None]  # [n, E]
                if self.indexer is not None:
                    ikeys = gather_entries(cache.idx_pool, s.block_table[None], num)  # [1, E, Di]
                    iq, iw = aux["q"]
                    scores = index_score(iq[None], ikeys, iw[None])  # [1, n, E]
                    idx, ok = index_topk(scores, visible[None], self.indexer.topk)
                    sel = torch.zeros(1, n, num, dtype=torch.bool).scatter_(-1, idx, ok)[0]
                keys = torch.cat([keys, entries], 0)
                valid = torch.cat([valid, sel], 1)
        o = sparse_attn(q[None], keys[None].to(q.dtype), valid[None], self.attn_sink, self.scale)
        return o[0]

    # -- many sequences, one token each ----------------------------------------------------------------------------
    def _decode(self, q: torch.Tensor, kv: torch.Tensor, aux: dict, plan: StepPlan,
                cache: LayerCache) -> torch.Tensor:
        tok, slots, pos, tables = plan.dec_tokens, plan.dec_slots, plan.dec_pos, plan.dec_tables
        win = self.win
        cache.win_kv[slots, pos % win] = kv[tok].to(cache.win_kv.dtype)
        keys = cache.win_kv[slots]  # [B, win, D]
        age = (pos[:, None] - torch.arange(win)[None]) % win  # ring row i holds position pos - age
        valid = age <= pos[:, None]  # [B, win]
        if self.ratio:
            m = self.ratio
            ckv, csc = aux["c"]
            self.compressor.decode(ckv[tok], csc[tok], pos, slots, cache.cmp_kv, cache.cmp_score, cache.cmp_pool,
                                   tables, self.rope, cache.cmp_pool.dtype)
            if self.indexer is not None:
                ikv, isc = aux["i"]
                self.indexer.compressor.decode(ikv[tok], isc[tok], pos, slots, cache.idx_kv, cache.idx_score,
                                               cache.idx_pool, tables, self.rope, cache.idx_pool.dtype)
            visible = (pos + 1) // m  # [B]
            num = int(visible.max())
            if num:
                entries = gather_entries(cache.cmp_pool, tables, num)  # [B, E, D]
                sel = torch.arange(num)[None] < visible[:, None]  # [B, E]
                if self.indexer is not None:
                    ikeys = gather_entries(cache.idx_pool, tables, num)  # [B, E, Di]
                    iq, iw = aux["q"]
                    scores = index_score(iq[tok][:, None], ikeys, iw[tok][:, None])  # [B, 1, E]
                    idx, ok = index_topk(scores, visible[:, None], self.indexer.topk)
                    sel = torch.zeros(len(tok), 1, num, dtype=torch.bool).scatter_(-1, idx, ok)[:, 0]
                keys = torch.cat([keys, entries], 1)
                valid = torch.cat([valid, sel], 1)
        o = sparse_attn(q[tok][:, None], keys.to(q.dtype), valid[:, None], self.attn_sink, self.scale)
        return o[:, 0]
