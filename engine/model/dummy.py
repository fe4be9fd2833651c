"""Random weights for any ModelConfig (the dummy load format): every parameter random, including those HF
zero-initialises (sinks, ape, gate bias, mHC base, tid2eid), so no path is hidden behind a zero."""

from __future__ import annotations

import torch

from engine.config import ModelConfig
from engine.model.model import Transformer


def random_weights(cfg: ModelConfig, seed: int = 0, with_mtp: bool = True) -> dict[str, torch.Tensor]:
    """Official-named fp32 tensors (int64 tid2eid) with O(1) activations: linears ~ N(0, 1/in), norms ~ 1 + N(0, .1),
    mHC fn small, base/scale O(1)."""
    g = torch.Generator().manual_seed(seed)
    shapes = {k: tuple(v.shape) for k, v in Transformer(cfg, with_mtp=with_mtp).state_dict(keep_vars=True).items()}
    out: dict[str, torch.Tensor] = {}
    for name, shape in shapes.items():
        leaf = name.rsplit(".", 1)[-1]
        if leaf == "tid2eid":
            out[name] = torch.stack([torch.randperm(cfg.n_routed_experts, generator=g)[: shape[1]]
                                     for _ in range(shape[0])])
        elif name.endswith("norm.weight"):
            out[name] = 1 + 0.1 * torch.randn(shape, generator=g)
        elif leaf.endswith("_fn"):
            out[name] = torch.randn(shape, generator=g) * (0.5 / shape[-1] ** 0.5)
        elif leaf.endswith(("_base", "_scale")):
            out[name] = torch.randn(shape, generator=g) * 0.5 + (0.5 if leaf.endswith("_scale") else 0.0)
        elif leaf in ("attn_sink", "bias"):
            out[name] = torch.randn(shape, generator=g)
        elif leaf == "ape":
            out[name] = torch.randn(shape, generator=g) * 0.5
        elif name == "embed.weight":
            out[name] = torch.randn(shape, generator=g)
        else:  # [out, in] linears
            out[name] = torch.randn(shape, generator=g) / shape[-1] ** 0.5
    return out
