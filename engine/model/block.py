"""A DeepSeek-V4 decoder block (two mHC sites: attention, MoE) and the MTP block built on it."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from engine.config import ModelConfig
from engine.model.attention import Attention
from engine.model.cache import KVCache, LayerCache, StepPlan
from engine.model.layers import Linear, RMSNorm, _empty
from engine.model.moe import MoE
from engine.model.ops import OpsUser
from engine.parallel import Parallel
from engine.profiling import no_split


class Block(OpsUser, nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, par: Parallel | None = None) -> None:
        super().__init__()
        self.cfg, self.layer_id, self.par = cfg, layer_id, par
        self.attn = Attention(cfg, layer_id, par)
        self.ffn = MoE(cfg, layer_id, par)
        self.attn_norm = RMSNorm(cfg.dim)
        self.ffn_norm = RMSNorm(cfg.dim)
        # each site's tensors by name: (mixing fn, scale, base, norm module)
        self._site_tensors = {s: (f"hc_{s}_fn", f"hc_{s}_scale", f"hc_{s}_base", f"{s}_norm") for s in ("attn", "ffn")}
        for site in ("attn", "ffn"):
            setattr(self, f"hc_{site}_fn", _empty(cfg.mix_hc, cfg.hc_dim))
            setattr(self, f"hc_{site}_base", _empty(cfg.mix_hc))
            setattr(self, f"hc_{site}_scale", _empty(3))

    def hc_site(self, x: torch.Tensor, site: str, inner: Callable[[torch.Tensor], torch.Tensor],
                split: Callable[[str], None] = no_split) -> torch.Tensor:
        """One half of the block around `inner` (attention or MoE): mHC collapse, norm, inner, mHC expand.
        x [T, n, dim] -> [T, n, dim]; `split` marks the stage boundaries (engine/regions.py). The attention site's
        `inner` returns the output before wo_b, which comes fused with the expand (`ops.attn_out_expand`)."""
        stage = "attn" if site == "attn" else "moe"
        ops = self.ops
        h, post, comb = self._hc_pre(x, site)
        split(f"{stage}.hc_pre")
        y = inner(h)
        if site == "attn":
            x = ops.attn_out_expand(y, self.attn.wo_b, x, post, comb)  # [T, n, dim]
        else:
            x = ops.hc_expand(y, x, post, comb)  # [T, n, dim]
        split(f"{stage}.hc_post")
        return x

    def site_args(self, site: str) -> tuple:
        """The arguments of `ops.hc_pre` after x for mHC site `site` (fn, scale, base, norm weight, hc_mult,
        iterations, hc_eps, norm_eps)."""
        c = self.cfg
        fn, scale, base, norm = self._site_tensors[site]
        return (getattr(self, fn), getattr(self, scale), getattr(self, base), getattr(self, norm).weight, c.hc_mult,
                c.hc_sinkhorn_iters, c.hc_eps, c.norm_eps)

    def _hc_pre(self, x: torch.Tensor, site: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The front of an mHC site: (h [T, dim] normed, post, comb)."""
        return self.ops.hc_pre(x, *self.site_args(site))

    def attn_half(self, x: torch.Tensor, plan: StepPlan, cache: KVCache) -> torch.Tensor:
        """The attention half. A decode-only step the op table's native decode takes (the host's `attn_decode`:
        `Attention.native_decode`) runs the attention's tail and wo_b + the mHC expand in one native call."""
        lc = cache.layers[self.layer_id]
        pack = self.attn.native_decode(plan, lc, x)
        if pack is not None:
            return self.attn.decode_native(x, lambda: self.site_args("attn"), plan, lc, pack)
        return self.hc_site(x, "attn", lambda h: self.attn(h, plan, lc))

    def ffn_half(self, x: torch.Tensor, plan: StepPlan, input_ids: torch.Tensor) -> torch.Tensor:
        """The MoE half. A table with `ffn_site` (the host's: hc_pre, gate, MoE FFN and hc_expand as one native
        call, the same kernels in the same order) takes it first where it can (None: it does not)."""
        pack = self.ffn.site_pack(lambda: self.site_args("ffn"), grouped=bool(plan.prefill))
        if pack is not None:
            g = self.ffn.gate
            out = self.ops.ffn_site(pack, x, g.tid2eid[input_ids] if g.hash else None)
            if out is not None:
                return out
        return self.hc_site(x, "ffn", lambda h: self.ffn(h, input_ids, grouped=bool(plan.prefill)))

    def forward(self, x: torch.Tensor, plan: StepPlan, cache: KVCache, input_ids: torch.Tensor) -> torch.Tensor:
        """x: residual streams [T, n, dim] -> [T, n, dim]. A decode-only step the op table's native decode takes
        runs as one native call where the table has `decode_layer` and the layer's step needs no pooling
        (`_decode_layer`), else as the two halves."""
        out = self._decode_layer(x, plan, cache.layers[self.layer_id], input_ids)
        if out is not None:
            return out
        return self.ffn_half(self.attn_half(x, plan, cache), plan, input_ids)

    def _decode_layer(self, x: torch.Tensor, plan: StepPlan, lc: LayerCache,
                      input_ids: torch.Tensor) -> torch.Tensor | None:
        """The whole layer through the op table's `decode_layer` (the host's: attn_front, attn_decode with the
        state writes and ffn_site in one native call, bit for bit the three one by one), or None (nothing done)
        where it does not take this step: no such op (`--numerics official` has none: engine/model/numerics.py), a
        step the attention's native decode does not take, a site without native arguments, or the indexer
        selecting (`Attention.selects`: the halves run, the attention's over the indexer's picks)."""
        op = getattr(self.ops, "decode_layer", None)
        dyn = None if op is None else self.attn.layer_inputs(plan, lc)
        if dyn is None or self.attn.selects(plan):
            return None
        if dyn[-1] and self.attn.closing_over_limit(dyn[-2]):  # the halves run, those blocks pooled op by op
            return None

        def build() -> object:  # the three sites' packs (each made again if stale), then the layer's from them
            site = self.ffn.site_pack(lambda: self.site_args("ffn"))
            if site is None:
                return self.ops.decode_layer_pack(None, None, None)
            return self.ops.decode_layer_pack(self.attn.front_pack(lambda: self.site_args("attn")),
                                              self.attn.decode_pack(lc), site)

        g = self.ffn.gate
        return op(self.ops.native_pack(self, "layer", build, lc), x, *dyn[:-1],
                  g.tid2eid[input_ids] if g.hash else None)


class MTPBlock(Block):
    """Multi-token prediction block (`mtp.0.*`): a sliding-only decoder layer fed with the main model's last streams
    and the embedding of the next token, with its own hc_head and norm; shares the embedding and head."""

    def __init__(self, cfg: ModelConfig, layer_id: int, par: Parallel | None = None) -> None:
        super().__init__(cfg, layer_id, par)
        self.e_proj = Linear(cfg.dim, cfg.dim)
        self.h_proj = Linear(cfg.dim, cfg.dim)
        self.enorm = RMSNorm(cfg.dim)
        self.hnorm = RMSNorm(cfg.dim)
        self.norm = RMSNorm(cfg.dim)
        self.hc_head_fn = _empty(cfg.hc_mult, cfg.hc_dim)
        self.hc_head_base = _empty(cfg.hc_mult)
        self.hc_head_scale = _empty(1)
