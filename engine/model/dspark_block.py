"""The DSpark draft head's modules (stored under `mtp.*`): its stages, Markov head and confidence head; what they
compute and which public code pinned it: engine/model/dspark_proposer.py."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from engine.config import ModelConfig
from engine.model.attention import Attention, _Group
from engine.model.block import Block
from engine.model.cache import DraftInput, LayerCache
from engine.model.layers import Embedding, Linear, RMSNorm, _empty
from engine.parallel import Parallel

# the plan a block's MoE half sees: no prefill chunk (its MoE runs ungrouped, as `MoE.forward` by default)
_BLOCK_PLAN = SimpleNamespace(prefill=())


class MarkovHead(nn.Module):
    """`markov_head.markov_w1` [vocab, rank] (previous token -> rank) and `markov_w2` [vocab, rank] (rank -> a
    logit bias over the vocabulary): DeepSpec's VanillaMarkov, the names vLLM loads from `mtp.<last>.markov_head`."""

    def __init__(self, vocab_size: int, rank: int) -> None:
        super().__init__()
        self.markov_w1 = Embedding(vocab_size, rank)
        self.markov_w2 = Linear(rank, vocab_size)

    def embed(self, prev_ids: torch.Tensor) -> torch.Tensor:
        """markov_w1[prev] in fp32: [...] -> [..., rank]."""
        w = self.markov_w1.weight
        if prev_ids.dim() == 1:
            return w.index_select(0, prev_ids).float()
        return w.index_select(0, prev_ids.reshape(-1)).view(*prev_ids.shape, w.shape[1]).float()

    def bias(self, emb: torch.Tensor) -> torch.Tensor:
        """The logit bias of a Markov embedding, fp32: [..., rank] -> [..., vocab]."""
        return self.markov_w2(emb.float())


class ConfidenceHead(nn.Module):
    """`confidence_head.proj` [1, dim + rank], no bias (stored bf16, computed in fp32)."""

    def __init__(self, dim: int, rank: int) -> None:
        super().__init__()
        self.proj = Linear(dim + rank, 1)

    def forward(self, h: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        """Raw confidence logits: h [..., dim], emb [..., rank] -> [...] fp32."""
        return self.proj(torch.cat([h.float(), emb.float()], -1)).squeeze(-1)


class DSparkAttention(Attention):
    """A stage's attention: the V4 attention weights of a sliding layer, run over [context ring | whole block]."""

    def __init__(self, cfg: ModelConfig, layer_id: int, par: Parallel | None = None) -> None:
        super().__init__(cfg, layer_id, par)
        if self.ratio:
            raise ValueError(f"DSpark stage {layer_id}: compress ratio {self.ratio}, expected 0 (dense window)")

    def context_kv(self, main_x: torch.Tensor, positions: torch.Tensor,
                   rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Window keys of the context: main_x [T, dim] at positions [T] -> [T, head_dim] (kv_norm, RoPE at p;
        `rope`: cos, sin of the positions where the caller made them already)."""
        cos, sin = rope if rope is not None else self.rope.cos_sin(positions)
        kv = self.ops.rms_norm(self.wkv(main_x), self.kv_norm.weight, self.eps)
        return self.ops.kv_quant(self._rope_tail(kv, cos, sin), self.rd)

    def context_rows(self, seqs: list[DraftInput]) -> tuple[list[int], list[int], list[int]]:
        """Which context positions of `seqs` (rows of main_x back to back) this rank's ring stores: only the last
        `window_size` positions of a long run (earlier ones would be overwritten) and, under cp, this rank's. ->
        (rows of main_x, their slots, their positions); plain lists: a step has a few rows, torch ops cost more."""
        rows, slots, pos, off = [], [], [], 0
        for s in seqs:
            for p in range(max(s.start, s.last - self.win + 1), s.start + s.n):
                if p % self.cp == self.rank:
                    rows.append(off + p - s.start)
                    slots.append(s.slot)
                    pos.append(p)
            off += s.n
        return rows, slots, pos

    def write_context(self, main_x: torch.Tensor, seqs: list[DraftInput], cache: LayerCache,
                      at: tuple[torch.Tensor, torch.Tensor, tuple] | None = None) -> None:
        """Store the context keys of positions [start, start + n) of each sequence (rows of main_x back to back)
        in its ring (the positions of `context_rows`). `at`: (slots, positions, (cos, sin)) of `context_rows`,
        where the caller made them for every stage at once and main_x holds those rows only."""
        if at is None:
            rows, slots, pos = (torch.tensor(v, dtype=torch.long, device=main_x.device)
                                for v in self.context_rows(seqs))
            main_x, at = main_x.index_select(0, rows), (slots, pos, self.rope.cos_sin(pos))
        slots, pos, rope = at
        if not pos.numel():
            return
        kv = self.context_kv(main_x, pos, rope)
        wl = cache.win_kv.shape[1]
        cache.win_store[slots, (pos if self.cp == 1 else torch.div(pos, self.cp, rounding_mode="floor")) % wl] = kv

    def ring_context(self, slots: torch.Tensor, last: torch.Tensor | None, cache: LayerCache,
                     valid: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's window of context keys for sequences whose last context position is last [B]: keys
        [B, wl, head_dim] and which rows hold a position <= last (the ring is filled for every final position;
        `valid`: that mask, where the caller made it already, then `last` is not read)."""
        wl = cache.win_kv.shape[1]
        return cache.win_store[slots], self._ring_valid(last, wl) if valid is None else valid

    def ring_inputs(self, cache: LayerCache, slots: torch.Tensor, pos: torch.Tensor, ctx_valid: torch.Tensor,
                    ) -> tuple | None:
        """`block_forward`'s `ring` for a block at positions pos [B, bs] of slots [B] whose context mask is ctx_valid
        [B, wl]: the block's keys go to the ring rows of its positions, and every row sees the valid context rows and
        the block's rows. None under cp, or where the ring has no room for the block past a window (spare rows <
        bs): its rows would overwrite context keys. The rows written are past the last final position, so
        `ring_context` masks them, and `write_context` writes them when their positions become final."""
        b, bs = pos.shape
        wl = cache.win_kv.shape[1]
        if self.cp != 1 or wl < self.win + bs:
            return None
        rows = pos % wl
        mask = ctx_valid.clone()
        mask.scatter_(1, rows, True)
        return (cache, slots.repeat_interleave(bs), rows.flatten(), mask.repeat_interleave(bs, 0))

    def block_valid(self, ctx_valid: torch.Tensor, bs: int) -> torch.Tensor:
        """Which keys each block query sees: ctx_valid [B, N] -> [B, bs, N + bs], every valid context key and
        every block key (non-causal inside the block)."""
        b, n = ctx_valid.shape
        in_block = torch.full((b, bs, bs), self.rank == 0, dtype=torch.bool, device=ctx_valid.device)  # once (cp)
        return torch.cat([ctx_valid[:, None].expand(b, bs, n), in_block], -1)

    def block(self, h: torch.Tensor, pos: torch.Tensor, ctx: torch.Tensor, ctx_valid: torch.Tensor) -> torch.Tensor:
        """h [B*bs, dim] (attn_norm applied) at block positions pos [B*bs]; ctx [B, N, head_dim] with ctx_valid
        [B, N] -> [B*bs, G*o_lora] (before wo_b). Every query sees every valid context key and every block key."""
        cos, sin = self.rope.cos_sin(pos)
        q, kv, _ = self.qkv(h, cos, sin)
        return self.block_attend(q, kv, ctx, self.block_valid(ctx_valid, h.shape[0] // ctx.shape[0]), cos, sin)

    def block_attend(self, q: torch.Tensor, kv: torch.Tensor, ctx: torch.Tensor, valid: torch.Tensor,
                     cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The block's attention after its q [B*bs, H, head_dim] and kv [B*bs, head_dim]: over ctx [B, N, head_dim]
        and the block's keys with `block_valid`'s mask -> [B*bs, G*o_lora] (before wo_b)."""
        b, bs = valid.shape[:2]
        keys = torch.cat([ctx, kv.view(b, bs, -1).to(ctx.dtype)], 1)  # [B, N + bs, head_dim]
        g = _Group(rows=slice(None), q=q.view(b, bs, self.n_heads, self.head_dim), keys=keys, valid=valid)
        o = self._attend([g])[0].flatten(0, 1)  # [B*bs, H, head_dim]
        return self._out(o, cos, sin)


class DSparkBlock(Block):
    """DSpark stage s = `mtp.<s>`: a V4 block with `DSparkAttention`; stage 0 also has `main_proj` + `main_norm`,
    the last stage `norm`, `hc_head_*`, `markov_head`, `confidence_head`."""

    def __init__(self, cfg: ModelConfig, layer_id: int, par: Parallel | None = None) -> None:
        super().__init__(cfg, layer_id, par)
        self.attn = DSparkAttention(cfg, layer_id, par)
        self.stage = layer_id - cfg.n_layers
        if self.stage == 0:
            self.main_proj = Linear(cfg.dim * len(cfg.dspark_target_layer_ids), cfg.dim)
            self.main_norm = RMSNorm(cfg.dim)
        if self.stage == cfg.n_mtp_layers - 1:
            self.norm = RMSNorm(cfg.dim)
            self.hc_head_fn = _empty(cfg.hc_mult, cfg.hc_dim)
            self.hc_head_base = _empty(cfg.hc_mult)
            self.hc_head_scale = _empty(1)
            self.markov_head = MarkovHead(cfg.vocab_size, cfg.dspark_markov_rank)
            self.confidence_head = ConfidenceHead(cfg.dim, cfg.dspark_markov_rank)

    def forward(self, *args, **kwargs) -> torch.Tensor:
        raise TypeError("a DSpark stage runs a whole draft block: engine.model.dspark_proposer.propose_dspark")

    def block_forward(self, x: torch.Tensor, ids: torch.Tensor, pos: torch.Tensor, ctx: torch.Tensor | None,
                      ctx_valid: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None,
                      valid: torch.Tensor | None = None, ring: tuple | None = None) -> torch.Tensor:
        """Streams x [B*bs, n, dim] of the block (ids / positions [B*bs]) -> [B*bs, n, dim]. `rope` (cos, sin of
        pos) and `valid` (`DSparkAttention.block_valid`) are every stage's: the caller may make them once. `ring`
        (layer cache, then per row: slot, ring row, ring mask; `ring_inputs`): the whole stage as the op table's
        `ring_layer` where it takes it (the block's keys written to the ring's spare rows; `ctx` None: gathered from
        that ring where it does not). Else the attention's front
        (hc_pre, q, kv) and the MoE half run as the table's fused sites where it has them."""
        a, ops = self.attn, self.ops
        cos, sin = rope if rope is not None else a.rope.cos_sin(pos)
        if ring is not None:
            out = ops.block_decoder.ring_layer(self, x, *ring, cos, sin, ids)
            if out is not None:
                return out
        if ctx is None:  # the context keys, gathered only here: where a stage runs op by op
            ctx = a.ring_context(ring[1][::pos.shape[0] // ctx_valid.shape[0]], None, ring[0], ctx_valid)[0]
        if valid is None:
            valid = a.block_valid(ctx_valid, x.shape[0] // ctx.shape[0])
        front = ops.block_decoder.attn_front(self, x, cos, sin)
        if front is None:
            h, post, comb = self._hc_pre(x, "attn")
            q, kv, _ = a.qkv(h, cos, sin)
        else:
            post, comb, q, kv = front[:4]
            kv = ops.kv_quant(kv, a.rd)  # as Attention.qkv
        x = ops.attn_out_expand(a.block_attend(q, kv, ctx, valid, cos, sin), a.wo_b, x, post, comb)
        return self.ffn_half(x, _BLOCK_PLAN, ids)
