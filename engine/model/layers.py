"""Small parameter holders with DeepSeek's official names, so a checkpoint loads as one table.

Modules here hold weights only; the math is in `nki_kernels.reference` (one definition per op).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.config import ModelConfig
from nki_kernels.reference import rope_cos_sin, rope_inv_freq


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


class Rope:
    """Per-layer RoPE tables: plain base `rope_theta` for sliding-only layers, YaRN-blended `compress_rope_theta` for
    layers with a compressor (used for q, window kv, compressed entries and indexer q/k alike; §2.3)."""

    def __init__(self, cfg: ModelConfig, compressed: bool, device: torch.device | str = "cpu") -> None:
        if compressed:
            yarn = (cfg.rope_factor, cfg.original_seq_len, cfg.beta_fast, cfg.beta_slow)
            self.inv_freq = rope_inv_freq(cfg.rope_head_dim, cfg.compress_rope_theta, yarn).to(device)
        else:
            self.inv_freq = rope_inv_freq(cfg.rope_head_dim, cfg.rope_theta, None).to(device)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_cos_sin(positions, self.inv_freq)
