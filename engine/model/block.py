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
        ops, c = self.ops, self.cfg
        fn, scale, base, norm = self._site_tensors[site]
        h, post, comb = ops.hc_pre(x, getattr(self, fn), getattr(self, scale), getattr(self, base),
                                   getattr(self, norm).weight, c.hc_mult, c.hc_sinkhorn_iters, c.hc_eps, c.norm_eps)
        split(f"{stage}.hc_pre")
        y = inner(h)
        if site == "attn":
            x = ops.attn_out_expand(y, self.attn.wo_b, x, post, comb)  # [T, n, dim]
        else:
            x = ops.hc_expand(y, x, post, comb)  # [T, n, dim]
        split(f"{stage}.hc_post")
        return x

    def attn_half(self, x: torch.Tensor, plan: StepPlan, cache: KVCache) -> torch.Tensor:
        return self.hc_site(x, "attn", lambda h: self.attn(h, plan, cache.layers[self.layer_id]))

    def ffn_half(self, x: torch.Tensor, plan: StepPlan, input_ids: torch.Tensor) -> torch.Tensor:
        return self.hc_site(x, "ffn", lambda h: self.ffn(h, input_ids, grouped=bool(plan.prefill)))

    def forward(self, x: torch.Tensor, plan: StepPlan, cache: KVCache, input_ids: torch.Tensor) -> torch.Tensor:
        """x: residual streams [T, n, dim] -> [T, n, dim]."""
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
