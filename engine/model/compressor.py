"""DeepSeek-V4's compressor (gated pooling of m tokens into one entry: CSA overlapping m=4 / HCA non-overlapping)
and the lightning indexer's projections (its own CSA compressor, queries and head weights). The indexer's top-k
and the attention over the entries are engine/model/attention.py's."""

from __future__ import annotations

import torch
from torch import nn

from engine.config import ModelConfig
from engine.model.cache import write_pool
from engine.model.layers import Linear, RMSNorm, Rope, _empty
from engine.model.ops import OpsUser
from engine.parallel import Parallel


class Compressor(OpsUser, nn.Module):
    """Gated pooling of m consecutive tokens into one entry; CSA (m=4) overlaps with the previous block (coff=2)."""

    def __init__(self, cfg: ModelConfig, ratio: int, head_dim: int, par: Parallel | None = None) -> None:
        super().__init__()
        self.ratio, self.head_dim, self.overlap = ratio, head_dim, ModelConfig.ratio_is_csa(ratio)
        self.rank, self.cp = (par.rank, par.cp) if par is not None else (0, 1)
        coff = 2 if self.overlap else 1
        self.wkv = Linear(cfg.dim, coff * head_dim)
        self.wgate = Linear(cfg.dim, coff * head_dim)
        self.ape = _empty(ratio, coff * head_dim)
        self.norm = RMSNorm(head_dim)
        self.eps = cfg.norm_eps
        self.rd = cfg.rope_head_dim
        self.rotate = False  # the indexer's compressor (official `rotate`): its keys take the indexer's rounding

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 projections of all tokens: x [T, dim] -> kv, score [T, coff*D] (ape not yet added)."""
        xf = x.float()
        return self.wkv(xf), self.wgate(xf)

    def finish(self, pooled: torch.Tensor, first_pos: torch.Tensor, rope: Rope, dtype: torch.dtype,
               cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """RMSNorm, then RoPE of the trailing dims at the position of the block's first token, then the entry's
        numerics rounding (engine/model/numerics.py: KV FP8 / the indexer's Hadamard + FP4). [W, D] -> [W, D].
        `cos_sin`: rope's tables at `first_pos`, where the caller has them already."""
        e = self.ops.rms_norm(self.ops.entry_in(pooled, dtype), self.norm.weight, self.eps)
        cos, sin = rope.cos_sin(first_pos) if cos_sin is None else cos_sin
        e = self.ops.rope_tail(e, cos, sin, self.rd).to(dtype)
        return self.ops.index_key_quant(e) if self.rotate else self.ops.kv_quant(e, self.rd)

    # The slot state holds the raw projections (kv, gate logit + ape) of recent tokens, token p in row p % S
    # (S = coff*m + spare rows, KVCache): a closing block reads its own m rows and, for CSA, the previous block's.
    # Nothing moves between rows, so a token that is later rolled back (a rejected speculative draft) leaves only
    # rows that a real token at the same position rewrites before any block reads them; S > 2m - 1 + spare keeps
    # every row a later block needs from being overwritten by drafts. "No previous block" (block 0) is rows never
    # written since the slot's reset (score -inf).

    def _state_rows(self, positions: torch.Tensor, rows: int) -> torch.Tensor:
        """Rows of `positions` (>= -m) in a state of `rows` rows (the dividend kept non-negative)."""
        return (positions + rows) % rows

    def _block_rows(self, w: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """State rows [.., m] of block(s) w and of the block before them."""
        m = self.ratio
        first = w.unsqueeze(-1) * m + torch.arange(m, device=w.device)
        return self._state_rows(first, rows), self._state_rows(first - m, rows)

    # -- one sequence, n new tokens --------------------------------------------------------------------------------
    def chunk(self, kv: torch.Tensor, score: torch.Tensor, start: int, st_kv: torch.Tensor, st_score: torch.Tensor,
              pool: torch.Tensor, table: torch.Tensor, rope: Rope, dtype: torch.dtype, taps: tuple = ()) -> None:
        """Feed tokens at positions [start, start+n) (kv/score [n, coff*D], ape not added) through the slot state
        `st_kv/st_score` [S, coff*D]; every block that closes becomes an entry written to `pool` via `table`.
        `taps` (prefix caching): (block boundary P in (start, start+n], state kv, state score) - the rows the block
        after P reads of the block before it (CSA; HCA reads none) go into that state (a snapshot's)."""
        m, n, rows = self.ratio, kv.shape[0], st_kv.shape[0]
        dev = kv.device
        r0 = start % m  # tokens of the current block already in the state
        pos = torch.arange(start, start + n, device=dev)
        score = score + self.ape[pos % m]
        head = self._state_rows(torch.arange(start - r0, start, device=dev), rows)
        seq_kv = torch.cat([st_kv[head], kv], 0)  # positions start-r0 .. start+n-1
        seq_sc = torch.cat([st_score[head], score], 0)
        n_close = (start + n) // m - start // m
        if n_close:
            blocks_kv = seq_kv[: n_close * m].view(n_close, m, -1)
            blocks_sc = seq_sc[: n_close * m].view(n_close, m, -1)
            prev = (None, None)
            if self.overlap:
                before = self._state_rows(torch.arange(start - r0 - m, start - r0, device=dev), rows)
                prev = (st_kv[before], st_score[before])
            pooled = self.ops.compress_pool(blocks_kv, blocks_sc, self.overlap, *prev)  # [W, D]
            w = torch.arange(start // m, start // m + n_close, device=dev)
            self._store(self.finish(pooled, w * m, rope, dtype), w, pool, table)
        if self.overlap:
            for p_end, t_kv, t_sc in taps:
                q = torch.arange(p_end - m, p_end, device=dev)
                t_kv[self._state_rows(q, rows)] = seq_kv[q - (start - r0)]
                t_sc[self._state_rows(q, rows)] = seq_sc[q - (start - r0)]
        keep = max(0, n - rows)  # the last `rows` tokens: distinct rows
        st_kv.index_copy_(0, self._state_rows(pos[keep:], rows), kv[keep:])
        st_score.index_copy_(0, self._state_rows(pos[keep:], rows), score[keep:])

    # -- B sequences, one new token each ---------------------------------------------------------------------------
    def decode_index(self, pos: torch.Tensor, slots: torch.Tensor, tables: torch.Tensor, rows: int,
                     rope: Rope, known: list[int] | None = None) -> tuple:
        """What `decode` derives from the step's positions alone, the same for every layer of this ratio and state
        size (a decode step makes it once: `StepPlan.shared`): (state rows [B], pos % m [B], closing), closing None
        when no block closes, else (their rows of the step, slots, block ids w, block tables, rope's (cos, sin) at
        w * m). `known`: pos as a list, where the caller has it (no host sync for the closing rows)."""
        m = self.ratio
        if known is None:
            closing = ((pos + 1) % m == 0).nonzero().flatten()
        else:
            closing = torch.tensor([i for i, p in enumerate(known) if (p + 1) % m == 0], dtype=torch.long,
                                   device=pos.device)
        if closing.numel() == 0:
            return self._state_rows(pos, rows), pos % m, None
        w = pos[closing] // m
        return self._state_rows(pos, rows), pos % m, (closing, slots[closing], w, tables[closing],
                                                      rope.cos_sin(w * m))

    def decode(self, kv: torch.Tensor, score: torch.Tensor, slots: torch.Tensor, index: tuple, st_kv: torch.Tensor,
               st_score: torch.Tensor, pool: torch.Tensor, dtype: torch.dtype) -> None:
        """kv/score [B, coff*D] of the tokens at the step's decode positions; states [S, rows, coff*D] indexed by
        slots [B]; `index` = decode_index(...) of this step."""
        row, phase, closing = index
        st_kv[slots, row] = kv
        st_score[slots, row] = score + self.ape[phase]
        if closing is None:
            return
        _, slots_c, w, tables_c, cos_sin = closing
        pooled = self._pool(st_kv, st_score, slots_c, w)
        self._store(self.finish(pooled, w * self.ratio, None, dtype, cos_sin), w, pool, tables_c)

    def _pool(self, st_kv: torch.Tensor, st_score: torch.Tensor, slots: torch.Tensor, w: torch.Tensor,
              ) -> torch.Tensor:
        """The pooled entry [B, D] of block w[b] from slot slots[b]'s state (CSA: with the block before it)."""
        cur, before = self._block_rows(w, st_kv.shape[1])  # [B, m]
        s = slots[:, None]
        if self.overlap:
            return self.ops.compress_pool(st_kv[s, cur][:, None], st_score[s, cur][:, None], True, st_kv[s, before],
                                          st_score[s, before])[:, 0]
        return self.ops.compress_pool(st_kv[s, cur], st_score[s, cur], False)

    def decode_static(self, kv: torch.Tensor, score: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor,
                      st_kv: torch.Tensor, st_score: torch.Tensor, pool: torch.Tensor, tables: torch.Tensor,
                      rope: Rope, dtype: torch.dtype) -> None:
        """`decode` with static shapes (compiled regions): every row pools, rows whose block does not close (or whose
        entry another cp rank owns) write to the pool's scratch block. kv/score [B, coff*D], pos/slots [B], tables
        [B, NB]; states indexed by slots (padded rows: scratch slot)."""
        m, rows = self.ratio, st_kv.shape[1]
        row = self._state_rows(pos, rows)
        st_kv[slots, row] = kv
        st_score[slots, row] = score + self.ape[pos % m]
        closing = (pos + 1) % m == 0  # [B]
        w = pos // m
        entries = self.finish(self._pool(st_kv, st_score, slots, w), w * m, rope, dtype)  # [B, D]
        keep = closing & (w % self.cp == self.rank)
        u = w // self.cp
        epb = pool.shape[1]
        blk = tables.gather(1, (u // epb).clamp(max=tables.shape[1] - 1)[:, None])[:, 0]  # [B]
        write_pool(pool, torch.where(keep, blk, pool.shape[0] - 1), u % epb, entries)

    def _store(self, entries: torch.Tensor, w: torch.Tensor, pool: torch.Tensor, tables: torch.Tensor) -> None:
        """Write entries [K, D] with ids w [K] into the pool; under cp only this rank's share (w % cp == rank), at
        local index w // cp. `tables` is one block table [nb] or one per entry [K, nb]."""
        if self.cp > 1:
            own = w % self.cp == self.rank
            entries, w = entries[own], w[own]
            tables = tables[own] if tables.dim() == 2 else tables
        u = w // self.cp
        epb = pool.shape[1]
        if tables.dim() == 2:
            write_pool(pool, tables[torch.arange(len(u), device=u.device), u // epb], u % epb, entries)
        else:
            write_pool(pool, tables[u // epb], u % epb, entries)


class Indexer(OpsUser, nn.Module):
    """Lightning indexer (CSA layers): its own CSA compressor at index_head_dim, scores with ReLU and head weights,
    causal top-k of the compressed entries per query (global across context-parallel ranks)."""

    def __init__(self, cfg: ModelConfig, par: Parallel | None = None) -> None:
        super().__init__()
        self.n_heads, self.head_dim, self.topk = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk
        self.wq_b = Linear(cfg.q_lora_rank, cfg.index_n_heads * cfg.index_head_dim)
        self.weights_proj = Linear(cfg.dim, cfg.index_n_heads)
        self.compressor = Compressor(cfg, 4, cfg.index_head_dim, par)
        self.compressor.rotate = True
        self.rd = cfg.rope_head_dim
        self.weight_scale = cfg.index_head_dim ** -0.5 * cfg.index_n_heads ** -0.5

    def queries(self, x: torch.Tensor, qr: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, Hi, Di] (RoPE on the trailing dims, no per-head norm) and head weights [T, Hi] fp32."""
        return self.queries_from(self.weights_proj(x), qr, cos, sin)

    def queries_from(self, wx: torch.Tensor, qr: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`queries` with weights_proj(x) given (the host's attn_front makes it beside the compressors')."""
        q = self.wq_b(qr).view(qr.shape[0], self.n_heads, self.head_dim)
        q = self.ops.index_query_quant(self.ops.rope_tail(q, cos.unsqueeze(1), sin.unsqueeze(1), self.rd))
        return q, self.ops.index_weights(wx, self.weight_scale)
