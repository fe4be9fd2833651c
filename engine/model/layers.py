"""Small parameter holders with DeepSeek's official names, so a checkpoint loads as one table.

Modules here hold weights only; the math is in `nki_kernels.reference` (one definition per op).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.config import ModelConfig
from nki_kernels.reference import rope_cos_sin, rope_inv_freq

# The one list of fp32 tensors. Stored as F32 in the released checkpoint (so always loaded as fp32): the mHC
# parameters (`hc_*`), attention sinks, compressor / indexer-compressor position biases (`ape`), the router bias.
_STORED_FP32 = ("attn_sink", ".ape", "gate.bias")
# Kept in fp32 by the model whatever the compute dtype: those, plus the router weight, the compressor projections,
# the head and every norm weight (official: router, compressor, logits and norm internals run in fp32).
_COMPUTE_FP32 = _STORED_FP32 + ("gate.weight", "compressor.wkv.weight", "compressor.wgate.weight", "head.weight",
                                "norm.weight")


def stored_fp32(name: str) -> bool:
    """Official tensor `name` is F32 in the released checkpoint."""
    return name.rsplit(".", 1)[-1].startswith("hc_") or name.endswith(_STORED_FP32)


def keeps_fp32(name: str) -> bool:
    """Official tensor `name` stays fp32 in the model whatever the compute dtype."""
    return stored_fp32(name) or name.endswith(_COMPUTE_FP32)


def _empty(*shape: int, dtype: torch.dtype = torch.float32) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device="meta"), requires_grad=False)


class Linear(nn.Module):
    """`weight` [out, in], dequantised at load time (FP8/FP4 checkpoints become plain tensors)."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.weight = _empty(out_features, in_features)


class RMSNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = _empty(dim)


class Embedding(nn.Module):
    def __init__(self, vocab_size: int, dim: int) -> None:
        super().__init__()
        self.weight = _empty(vocab_size, dim)


class Rope(nn.Module):
    """Per-layer RoPE tables: plain base `rope_theta` for sliding-only layers, YaRN-blended `compress_rope_theta` for
    layers with a compressor (used for q, window kv, compressed entries and indexer q/k alike). `inv_freq` is a
    non-persistent buffer: not in the checkpoint, but it moves with the model to its device."""

    def __init__(self, cfg: ModelConfig, compressed: bool) -> None:
        super().__init__()
        if compressed:
            yarn = (cfg.rope_factor, cfg.original_seq_len, cfg.beta_fast, cfg.beta_slow)
            inv_freq = rope_inv_freq(cfg.rope_head_dim, cfg.compress_rope_theta, yarn)
        else:
            inv_freq = rope_inv_freq(cfg.rope_head_dim, cfg.rope_theta, None)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_cos_sin(positions, self.inv_freq)
