"""Small parameter holders with DeepSeek's official names, so a checkpoint loads as one table.

Modules here hold weights only; the math is in `nki_kernels.reference` (one definition per op).
"""

from __future__ import annotations

import torch
from torch import nn

from engine.config import ModelConfig
from engine.model.ops import OpsUser
from nki_kernels import weight_layouts
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


class Linear(OpsUser, nn.Module):
    """y = x @ W^T with `weight` as the checkpoint stores it (official names, so the loader is one table):

    * fmt None: `weight` [out, in] float (bf16/fp32 tensors, or FP8/FP4 ones dequantised at load);
    * fmt "fp8": `weight` = e4m3 codes as uint8 [out, in], `scale` = UE8M0 bytes [ceil(out/128), ceil(in/128)];
    * fmt "fp4": `weight` = packed e2m1 codes as uint8 [out, in/2] (low nibble = even element), `scale` = UE8M0
      bytes [out, in/32].
    The GEMM is the op table's (`linear` / `fp8_linear` / `fp4_linear`): fp32 accumulation, result in x.dtype."""

    def __init__(self, in_features: int, out_features: int, fmt: str | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features, self.fmt = in_features, out_features, fmt
        if fmt is None:
            self.weight = _empty(out_features, in_features)
        elif fmt == "fp8":
            self.weight = _empty(out_features, in_features, dtype=torch.uint8)
            self.scale = _empty(-(-out_features // 128), -(-in_features // 128), dtype=torch.uint8)
        elif fmt == "fp4":
            if in_features % 32:
                raise ValueError(f"fp4 Linear: in_features={in_features} is not a multiple of 32")
            self.weight = _empty(out_features, in_features // 2, dtype=torch.uint8)
            self.scale = _empty(out_features, in_features // 32, dtype=torch.uint8)
        else:
            raise ValueError(f"Linear fmt {fmt!r}: expected None, 'fp8' or 'fp4'")
        self._dense: tuple | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fmt is None:
            return self.ops.linear(x, self.weight)
        if self.fmt == "fp8":
            return self.ops.fp8_linear(x, self.weight, self.scale)
        return self.ops.fp4_linear(x, self.weight, self.scale)

    def dense(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight as a float [out, in] tensor (dequantised once and cached for a stored one): for the kernels
        that take dense weights only (the fused attention tail)."""
        if self.fmt is None:
            return self.weight
        name = f"dense.{dtype}"
        if torch.compiler.is_compiling():  # traced: the one made at load (engine/model/kernel_weights.py)
            found = weight_layouts.attached(self.weight, name)
            if found is None:
                raise RuntimeError(f"Linear.dense({dtype}) of a stored {self.fmt} weight was not made at load: a "
                                   "traced graph does not dequantise weights")
            return found
        key = (self.weight.data_ptr(), self.weight._version, dtype)
        if self._dense is None or self._dense[0] != key:
            from engine.model.ops import dequant

            self._dense = (key, dequant(self.weight, self.scale, self.fmt, dtype))
            weight_layouts.attach(self.weight, name, self._dense[1])
        return self._dense[1]

    @property
    def nbytes(self) -> int:
        """Bytes a GEMM with this weight reads (weight + scales)."""
        n = self.weight.numel() * self.weight.element_size()
        return n + (self.scale.numel() * self.scale.element_size() if self.fmt is not None else 0)


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
            self.key = (cfg.rope_head_dim, cfg.compress_rope_theta, yarn)
        else:
            self.key = (cfg.rope_head_dim, cfg.rope_theta, None)  # what the table is (layers with one key share it)
        self.register_buffer("inv_freq", rope_inv_freq(*self.key), persistent=False)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_cos_sin(positions, self.inv_freq)
