"""The host table's decode of one Block (engine/model/block.py asks its op table's `block_decoder`): the whole
layer in one native call (decode_layer), else the attention half (attn_front, attn_decode) and the MoE
half (ffn_site) each in one call, and the MoE FFN after the gate (moe_ffn); outside the blocks, an MTP block's input
(mtp_input) and the LM head (lm_head) each in one call. It reads the block's modules
and its layer cache and keeps the packs it makes, so the model holds no native state; each method returns None
where the step or the tensors are not what its kernels take (nothing counted, no state written: the block runs
its ops one by one). Every native call is the op-by-op host path's kernels in its order: the same numbers bit for
bit (attn.c states the contract once)."""

from __future__ import annotations

import weakref
from typing import Any

import torch

from engine.host_kernels.attn_ops import attn_decode, attn_decode_takes, attn_front, decode_pack, front_pack
from engine.host_kernels.layer_ops import decode_layer, layer_pack, mtp_draft, mtp_pass
from engine.host_kernels.moe_ops import moe_ffn as moe_ffn_call
from engine.host_kernels.native import max_m
from engine.host_kernels.packs import PackStore
from engine.host_kernels.step_ops import ffn_site, lm_head, lm_head_pack, mtp_input, mtp_input_pack, site_pack

# a compressor's closing blocks on a step where none closes (`_layer_inputs`)
_NO_BLOCK = (torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int64), torch.empty(0, 1),
             torch.empty(0, 1))

_NO_TABLES = torch.zeros(1, 1, dtype=torch.int64)  # `ring_layer`: no compressed entry, no block table read

ROPE_ROWS = 1 << 16  # positions the drafting's RoPE table holds at most (rd/2 = 32: 16 MB for cos and sin)


def _none() -> None:
    return None


class HostBlockDecoder:
    """The native decode sites of one host op table; each flag says whether the table has that site (off under
    `--numerics official`: the native sites quantise no activations)."""

    def __init__(self, layer: bool = True, front: bool = True, decode: bool = True, ffn: bool = True,
                 moe: bool = True, mtp: bool = True, head: bool = True, draft: bool = True) -> None:
        self.use_layer, self.use_front, self.use_decode, self.use_ffn, self.use_moe = layer, front, decode, ffn, moe
        self.use_mtp, self.use_head, self.use_draft = mtp, head, draft
        self.packs = PackStore()
        self._moe_args: weakref.WeakKeyDictionary[Any, tuple] = weakref.WeakKeyDictionary()
        self._ropes: weakref.WeakKeyDictionary[Any, tuple[torch.Tensor, ...]] = weakref.WeakKeyDictionary()

    # -- the whole layer ---------------------------------------------------------------------------------------
    def layer(self, block: Any, x: torch.Tensor, plan: Any, lc: Any, input_ids: torch.Tensor) -> torch.Tensor | None:
        """The block's output streams from one `decode_layer` call, or None where it does not take this step: a
        step the attention's native decode does not take (`_decodes_natively`), a site without native arguments,
        the indexer selecting (its top-k runs between the attention's two parts), or more closing blocks than the
        native pooling takes."""
        attn = block.attn
        if not self.use_layer:
            return None
        dyn = self._layer_inputs(attn, plan, lc)
        if dyn is None or attn.selects(plan):
            return None
        if dyn[-1] and self._closing_over_limit(dyn[-2]):
            return None

        g = block.ffn.gate
        hold = self._hold(block, plan)
        out = decode_layer(self._layer_pack(block, lc), x, *dyn[:-1], g.tid2eid[input_ids] if g.hash else None, hold)
        if hold is not None and out is not None:
            plan.held += 1
        return out

    @staticmethod
    def _hold(block: Any, plan: Any) -> tuple[int, int, int, int] | None:
        """attn_decode's `hold` for the block in this step: where the plan asks its layer's input streams held."""
        if plan.hold is None or (at := plan.hold[0].get(block.layer_id)) is None:
            return None
        return at, plan.dec_pos.data_ptr(), plan.hold[1], plan.hold[2]

    def ring_layer(self, block: Any, x: torch.Tensor, lc: Any, slots: torch.Tensor, ring_rows: torch.Tensor,
                   ring_valid: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   input_ids: torch.Tensor) -> torch.Tensor | None:
        """A sliding-only block over rows whose window the caller says (the DSpark block: its rows see the context
        and each other) in one `decode_layer` call: every row's kv written at ring_rows [B] of its slot's ring
        (slots [B]) first, then each row attends over the ring rows ring_valid [B, wl] marks; or None where it does
        not take the call (nothing written)."""
        a = block.attn
        if not self.use_layer or a.ratio or a.par is not None or lc.win_store.fmt != "auto" \
                or torch.compiler.is_compiling():
            return None
        g = block.ffn.gate
        return decode_layer(self._layer_pack(block, lc), x, cos, sin, slots, ring_rows, ring_valid, _NO_TABLES, 0,
                            None, (), g.tid2eid[input_ids] if g.hash else None)

    def _mtp_input_pack(self, model: Any, blk: Any) -> Any:
        """MTP block `blk`'s `mtp_input` pack (the model's embedding, the block's norms and projections)."""
        return self.packs.get(blk, "mtp_input", lambda: mtp_input_pack(
            model.embed.weight, blk.enorm.weight, blk.hnorm.weight, blk.e_proj, blk.h_proj, model.cfg.norm_eps))

    def _lm_head_pack(self, model: Any, hc: Any, norm: Any) -> Any:
        """The `lm_head` pack of hc_head owner `hc` (the model or an MTP block) with final norm `norm`."""
        cfg = model.cfg
        return self.packs.get(hc, "lm_head", lambda: lm_head_pack(
            hc.hc_head_fn, hc.hc_head_scale, hc.hc_head_base, norm.weight, model.head, cfg.hc_eps, cfg.norm_eps), norm)

    def _layer_pack(self, block: Any, lc: Any) -> Any:
        """The block's `decode_layer` pack for layer cache `lc`."""
        def build() -> Any:  # the three sites' packs (each made again if stale), then the layer's from them
            site = self._site_pack(block)
            if site is None:
                return layer_pack(None, None, None)
            return layer_pack(self._front_pack(block), self._decode_pack(block.attn, lc), site)

        return self.packs.get(block, "layer", build, lc)

    # -- the attention half --------------------------------------------------------------------------------------
    def attn_half(self, block: Any, x: torch.Tensor, plan: Any, lc: Any) -> torch.Tensor | None:
        """The block's attention half (x: the residual streams [B, n, dim] -> the new streams) as the front (one
        `attn_front` call where it takes it, else hc_pre, the q / kv front and the compressors' projections op by
        op), the state writes, where the indexer selects its queries, then one `attn_decode` call (the keys' gather,
        sparse_attn, inverse RoPE, wo_a, wo_b, hc_expand); None where `attn_decode` does not take this step, decided
        before any state is written."""
        attn = block.attn
        if not self._decodes_natively(attn, plan, lc):
            return None
        pack = self._decode_pack(attn, lc)
        cos, sin = attn.cos_sin(plan)  # [B, rd/2]
        if not attn_decode_takes(pack, len(plan.seqs), x, cos, sin):
            return None
        ops = attn.ops
        index = attn.selects(plan)
        fpack = self._front_pack(block, index)
        front = None if fpack is None else attn_front(fpack, x, cos, sin)
        if front is None:
            h, post, comb = ops.hc_pre(x, *block.site_args("attn"))
            q, kv, qr = attn.qkv(h, cos, sin)
            aux = attn.aux(h, qr, cos, sin, index=index)
        else:
            post, comb, q, kv, qr, *proj = front
            kv = ops.kv_quant(kv, attn.rd)  # as Attention.qkv (numerics: FP8 non-RoPE dims)
            aux = {name: (proj[2 * i], proj[2 * i + 1]) for i, name in enumerate(("c", "i")[:len(proj) // 2])}
            if index:  # the last projection: the indexer's weights_proj
                aux["q"] = attn.indexer.queries_from(proj[-1], qr, cos, sin)
        cos, sin, slots, ring_rows, ring_valid, tables, nloc, visible, crow, closes = self._layer_inputs(attn, plan, lc)
        native_index = index and len(plan.seqs) <= max_m("index")  # the rows index_score takes
        writes = None
        if kv.dtype is not torch.float32 or self._closing_over_limit(crow) \
                or index and not native_index and closes:  # (the scores below read a closing block's entry)
            attn.decode_writes(kv, aux, plan, lc)
        else:  # Attention.decode_writes as data, for attn_decode to make natively (the same rows and values)
            writes = (kv, ring_rows, *((*aux[key], *c) for key, c in zip(("c", "i"), crow, strict=False)))
        keep = None
        if index and not native_index:  # the indexer's picks in torch: [B, nloc]
            keep = attn.decode_picks(aux["q"], lc, tables, nloc, visible)
        # else, where the indexer selects, attn_decode scores the entries and picks them after the writes
        hold = self._hold(block, plan)
        out = attn_decode(pack, q, slots, ring_valid, tables, nloc, visible, cos, sin, x, post, comb, writes, keep,
                          (*aux["q"], attn.indexer.topk) if native_index else None, hold)
        if hold is not None:
            plan.held += 1
        return out

    def attn_front(self, block: Any, x: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor) -> tuple[torch.Tensor, ...] | None:
        """The attention half's front in one `attn_front` call: (post, comb, q, kv before the KV numerics, qr,
        *the compressors' projections), or None where it does not take the call."""
        pack = self._front_pack(block)
        return None if pack is None else attn_front(pack, x, cos, sin)

    # -- the MoE half and the MoE FFN ----------------------------------------------------------------------------
    def ffn_half(self, block: Any, x: torch.Tensor, plan: Any, input_ids: torch.Tensor) -> torch.Tensor | None:
        """The block's MoE half (hc_pre, gate, MoE FFN, hc_expand) in one `ffn_site` call, or None."""
        pack = self._site_pack(block, grouped=bool(plan.prefill))
        if pack is None:
            return None
        g = block.ffn.gate
        return ffn_site(pack, x, g.tid2eid[input_ids] if g.hash else None)

    def moe_ffn(self, moe: Any, x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor) -> torch.Tensor | None:
        """The MoE FFN after the gate (routed experts + shared expert) of MoE `moe` in one native call (the custom op
        inside a graph being compiled), or None where moe_ffn declines (counted by reason)."""
        if not self.use_moe or not moe.stacked:
            return None
        routed, shared = self._moe_inputs(moe)
        return moe_ffn_call(x, weights, indices, moe.experts[moe.local.start].limit, moe.local.start, routed,
                               shared, _none)

    # -- the draft head's input and the LM head -------------------------------------------------------------------
    def mtp_input(self, model: Any, blk: Any, x: torch.Tensor, next_ids: torch.Tensor) -> torch.Tensor | None:
        """Transformer.mtp_input of MTP block `blk` in one `mtp_input` call, or None."""
        if not self.use_mtp or torch.compiler.is_compiling():
            return None
        return mtp_input(self._mtp_input_pack(model, blk), x, next_ids)

    def logits(self, model: Any, x: torch.Tensor, hc: Any, norm: Any) -> torch.Tensor | None:
        """Transformer.logits (hc_head of `hc`, final norm `norm`, the head) in one `lm_head` call, or None."""
        if not self.use_head or torch.compiler.is_compiling():
            return None
        return lm_head(self._lm_head_pack(model, hc, norm), x)

    def mtp_pass(self, model: Any, blk: Any, x: torch.Tensor, next_ids: torch.Tensor, plan: Any, lc: Any,
                 rows: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """Transformer.mtp_pass of MTP block `blk` (its input, the block, the head over `rows` of its output and
        their argmax) in one `mtp_pass` call where `mtp_input`, `layer` and `logits` would each take theirs, or None."""
        if not (self.use_mtp and self.use_head and self.use_layer) or torch.compiler.is_compiling():
            return None
        attn = blk.attn
        dyn = self._layer_inputs(attn, plan, lc)
        if dyn is None or attn.selects(plan) or dyn[-1] and self._closing_over_limit(dyn[-2]):
            return None
        inp, head = self._mtp_input_pack(model, blk), self._lm_head_pack(model, blk, blk.norm)
        return mtp_pass(self._layer_pack(blk, lc), inp, head, x, next_ids, rows, *dyn[:-1])

    def mtp_draft(self, model: Any, blk: Any, x: torch.Tensor, next_ids: torch.Tensor, seqs: list, lc: Any,
                  k: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """propose_mtp's k greedy drafts of MTP block `blk` in one `mtp_draft` call, without a step plan: the
        catch-up over the final positions of `seqs` (DraftInputs; rows back to back, each a decode row: at most
        `spare` + 1 a sequence, as StepPlan.build's decode rows, and within the window: the rows before each one's
        last write their ring rows only, as propose_mtp's) and the k - 1 recursion passes after each one's last
        -> (logits [k, R, V], tokens [k, R]), or None (then propose_mtp plans the passes and runs each)."""
        attn = blk.attn
        sites = self.use_draft and self.use_mtp and self.use_head and self.use_layer and self.use_decode
        if not sites or attn.ratio or attn.par is not None or lc.win_store.fmt != "auto" \
                or torch.compiler.is_compiling():
            return None
        most = min(lc.win_kv.shape[1] - attn.win + 1, attn.win)  # spare + 1 rows, all within the window
        pos, slots, rows = [], [], []
        for s in seqs:
            if not 0 < s.n <= most:
                return None
            pos.extend(range(s.start, s.start + s.n))
            slots.extend([s.slot] * s.n)
            rows.append(len(pos) - 1)
        inp, head = self._mtp_input_pack(model, blk), self._lm_head_pack(model, blk, blk.norm)
        return mtp_draft(self._layer_pack(blk, lc), inp, head, x, next_ids, pos, slots, rows, k,
                         self._rope_rows(attn.rope, min(pos), max(pos) + k), attn.win)

    def _rope_rows(self, rope: Any, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """(cos, sin, p0): `rope.cos_sin` of positions p0, p0 + 1, ... covering [lo, hi), the rows the one-call
        drafting reads (an element's cos / sin do not depend on the call's shape: a test). Up to `ROPE_ROWS`
        positions a table from 0 kept per Rope (grown by doubling; made again if its inv_freq buffer is another
        tensor): no call a step; past that, [lo, hi) itself, one call (the table stays bounded at long contexts)."""
        if hi > ROPE_ROWS:
            return (*rope.cos_sin(torch.arange(lo, hi)), lo)
        tab = self._ropes.get(rope)
        if tab is None or tab[0].shape[0] < hi or tab[2] is not rope.inv_freq:
            size = min(max(256, 1 << (hi - 1).bit_length(), 2 * tab[0].shape[0] if tab is not None else 0), ROPE_ROWS)
            tab = self._ropes[rope] = (*rope.cos_sin(torch.arange(size)), rope.inv_freq)
        return tab[0], tab[1], 0

    # -- what the sites read from the modules --------------------------------------------------------------------
    def _moe_inputs(self, moe: Any) -> tuple[tuple, tuple]:
        """(fmt, (w1, s1, w3, s3, w2, s2)) of the routed stacks and of the shared expert, kept while those tensors
        are the module's (a decode step asks in every layer); made afresh inside a graph being compiled."""
        if torch.compiler.is_compiling():
            return _weights_of(moe, None), _weights_of(moe, moe.shared_experts)
        key = (id(moe.stack_w1), id(moe.shared_experts.w1.weight))
        cached = self._moe_args.get(moe)
        if cached is None or cached[0] != key:
            cached = self._moe_args[moe] = (key, _weights_of(moe, None), _weights_of(moe, moe.shared_experts))
        return cached[1], cached[2]

    def _site_pack(self, block: Any, grouped: bool = False) -> Any | None:
        """The block's `ffn_site` pack, or None where MoE.forward would not take the one-call MoE FFN (unstacked
        experts, the capacity path, expert parallelism, a graph being compiled)."""
        moe = block.ffn
        if not (self.use_ffn and self.use_moe) or moe.par is not None or not moe.stacked \
                or (grouped and moe.capacity > 0) or torch.compiler.is_compiling():
            return None

        def build() -> Any:
            g = moe.gate
            routed, shared = self._moe_inputs(moe)
            return site_pack(block.site_args("ffn"), g.weight, g.topk, g.route_scale,
                                      None if g.hash else g.bias, g.hash, moe.experts[moe.local.start].limit,
                                      moe.local.start, routed, shared)

        return self.packs.get(moe, "ffn_site", build)

    def _front_pack(self, block: Any, index: bool = False) -> Any | None:
        """The attention's `attn_front` pack (`index`: with the indexer's weights_proj after the compressors'
        projections, for the steps where it selects), or None where the table has no such site."""
        if not self.use_front:
            return None
        a = block.attn
        projs = tuple(lin for c in a.compressors() for lin in (c.wkv, c.wgate))
        return self.packs.get(a, "front.index" if index else "front", lambda: front_pack(
            block.site_args("attn"), a.wq_a, a.q_norm.weight, a.wq_b, a.wkv, a.kv_norm.weight, a.n_heads, a.rd, a.eps,
            projs + (a.indexer.weights_proj,) if index else projs))

    def _decode_pack(self, a: Any, lc: Any) -> Any:
        """The attention's `attn_decode` pack for layer cache `lc`."""
        def build() -> Any:
            stores = ((lc.cmp_kv, lc.cmp_score, lc.cmp_pool), (lc.idx_kv, lc.idx_score, lc.idx_pool))
            states = [(*st[:2], c.ape, c.norm.weight, st[2], c.ratio, c.eps)
                      for c, st in zip(a.compressors(), stores, strict=False)]
            return decode_pack(a.attn_sink, a.scale, a.rd, a.wo_a.weight, a.cfg.o_groups, a.wo_b, lc.win_kv,
                                        lc.cmp_pool if a.ratio else None, tuple(states))

        return self.packs.get(a, "decode", build, lc)

    def _decodes_natively(self, a: Any, plan: Any, lc: Any) -> bool:
        """Whether this step is one `attn_decode` / `decode_layer` may take, by the plan and the cache alone: a
        decode-only step whose group is every row, one rank, eager, and the window ring and the entries held as
        values (--kv-cache-dtype auto)."""
        return self.use_decode and a.par is None and not plan.prefill and plan.dec_tokens is not None \
            and not torch.compiler.is_compiling() and lc.win_store.fmt == "auto" \
            and not (a.ratio and lc.cmp_store.fmt != "auto") and a.decode_ix(plan, lc).all_rows

    def _layer_inputs(self, a: Any, plan: Any, lc: Any) -> tuple | None:
        """The step's arguments of `decode_layer` / `attn_decode` for attention `a`: cos, sin, slots, ring rows,
        ring valid, tables, entry count, visible counts, then per compressor its state rows and phases and its
        closing blocks (their rows of the step, block ids, RoPE's cos and sin at their first positions:
        `Compressor.decode_index`), and whether any block closes; None where `_decodes_natively` says no. Made once
        a step for every layer of the same kind (`StepPlan.shared`)."""
        if not self.use_decode or a.par is not None or lc.win_store.fmt != "auto" \
                or a.ratio and lc.cmp_store.fmt != "auto":
            return None
        states = (lc.cmp_kv, lc.idx_kv)[:len(a.compressors())]
        key = ("layer", a.ratio, a.indexer is not None, a.rope.key, a.win, lc.win_kv.shape[1],
               *(st.shape[1] for st in states))
        return plan.shared(key, lambda: self._make_layer_inputs(a, plan, lc, states))

    def _make_layer_inputs(self, a: Any, plan: Any, lc: Any, states: tuple) -> tuple | None:
        if not self._decodes_natively(a, plan, lc):  # one rank, every row: the ring is written row for row
            return None
        ix = a.decode_ix(plan, lc)
        crow, closes = [], False
        for comp, st_kv in zip(a.compressors(), states, strict=True):
            rows, phase, closing = a.cmp_index(plan, st_kv, comp)
            if closing is None:
                crow.append((rows, phase, *_NO_BLOCK))
            else:
                crow.append((rows, phase, closing[0], closing[2], *closing[4]))
                closes = True
        cos, sin = a.cos_sin(plan)
        nloc, visible = 0, None
        if a.ratio:
            visible, found = a.step_entries(plan)
            nloc = found[0] if found is not None else 0
        return (cos, sin, plan.dec_slots, ix.ring_write[1], ix.valid, plan.dec_tables, nloc, visible, tuple(crow),
                closes)

    @staticmethod
    def _closing_over_limit(crow: tuple) -> bool:
        """Whether a compressor closes more blocks this step than a fused decode call pools (max_m("close")):
        then the layer runs op by op (Attention.decode_writes pools them)."""
        close_max = max_m("close")
        return any(c[2].numel() > close_max for c in crow)


def _weights_of(moe: Any, ex: Any | None) -> tuple[str | None, tuple[torch.Tensor | None, ...]]:
    """(fmt, (w1, s1, w3, s3, w2, s2)) of expert `ex`, or of MoE `moe`'s routed stacks (None): moe_ffn's inputs."""
    fmt = (ex or moe.experts[moe.local.start]).w1.fmt
    if ex is None:
        return fmt, tuple(getattr(moe, f"stack_{w}{a}", None) for w in ("w1", "w3", "w2") for a in ("", "_scale"))
    return fmt, tuple(getattr(getattr(ex, w), a, None) for w in ("w1", "w3", "w2") for a in ("weight", "scale"))

