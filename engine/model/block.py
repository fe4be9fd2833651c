"""A DeepSeek-V4 decoder block (two mHC sites: attention, MoE) and the MTP block built on it."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from engine.config import ModelConfig
from engine.model.attention import Attention
from engine.model.cache import KVCache, StepPlan
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
        """The attention half: the op table's fused half where it takes the step (`ops.block_decoder`), else the
        mHC site around the attention."""
        lc = cache.layers[self.layer_id]
        out = self.ops.block_decoder.attn_half(self, x, plan, lc)
        if out is not None:
            return out
        return self.hc_site(x, "attn", lambda h: self.attn(h, plan, lc))

    def ffn_half(self, x: torch.Tensor, plan: StepPlan, input_ids: torch.Tensor) -> torch.Tensor:
        """The MoE half: the op table's fused half where it takes the step, else the mHC site around the MoE."""
        out = self.ops.block_decoder.ffn_half(self, x, plan, input_ids)
        if out is not None:
            return out
        return self.hc_site(x, "ffn", lambda h: self.ffn(h, input_ids, grouped=bool(plan.prefill)))

    def forward(self, x: torch.Tensor, plan: StepPlan, cache: KVCache, input_ids: torch.Tensor) -> torch.Tensor:
        """x: residual streams [T, n, dim] -> [T, n, dim]: the whole layer through the op table's fused decode
        where it takes the step (engine/host_kernels/block_decoder.py), else the two halves."""
        out = self.ops.block_decoder.layer(self, x, plan, cache.layers[self.layer_id], input_ids)
        if out is not None:
            return out
        return self.ffn_half(self.attn_half(x, plan, cache), plan, input_ids)


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
