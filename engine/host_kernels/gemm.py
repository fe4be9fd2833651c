"""The host GEMMs (gemv.c): `linear` (bf16 weight, fp32 x), `fp8_linear`, `fp4_linear` and the MoE's
`stack_linear`, each reading the stored weight bytes once and decoding them in registers; the reference (dequantised
chunks on MKL) runs past each build's row limit and for every case the kernels do not take, counted by reason.
Custom ops (`deepinfer::host_*`), so compiled region graphs call them without a graph break."""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.host_kernels.native import F32, _count, _f32, _native, _native_op, _why_not
from nki_kernels import dispatch, reference


def _run(fmt: str, x: torch.Tensor, w: torch.Tensor, s: torch.Tensor | None, n: int) -> torch.Tensor:
    k = x.shape[-1]
    xf = _f32(x)
    if not w.is_contiguous():
        w = w.contiguous()
    if s is not None and not s.is_contiguous():
        s = s.contiguous()
    y = torch.empty(*x.shape[:-1], n, dtype=F32)
    _native().gemv(fmt, xf, w, s, y, xf.numel() // k, n, k)
    return y if x.dtype is torch.float32 else y.to(x.dtype)


def linear_impl(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    why = _why_not("linear", x, weight)
    if why is None and x.dtype != torch.float32:
        why = "dtype"  # a bf16 weight with bf16 x is the same-dtype case below; bf16 x with another weight: ref
    if why is None and weight.dtype != torch.bfloat16:
        why = "same dtype" if weight.dtype == x.dtype else "dtype"
    if why is not None:
        return dispatch.fallback("host.linear", why, lambda: reference.linear(x, weight))
    _count("host.linear")
    return _run("bf16", x, weight, None, weight.shape[0])


def _quant_linear(fmt: str, x: torch.Tensor, w_u8: torch.Tensor, scale_u8: torch.Tensor,
                  ref: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """A stored-format GEMM (fmt fp8 | fp4: uint8 weight bytes + UE8M0 scale bytes) natively, else `ref`."""
    why = _why_not(fmt, x, w_u8, scale_u8)
    if why is None and (w_u8.dtype != torch.uint8 or scale_u8.dtype != torch.uint8):
        why = "dtype"
    if why is not None:
        return dispatch.fallback(f"host.{fmt}", why, lambda: ref(x, w_u8, scale_u8))
    _count(f"host.{fmt}")
    return _run(fmt, x, w_u8, scale_u8, w_u8.shape[0])


def fp8_linear_impl(x: torch.Tensor, w_u8: torch.Tensor, scale_u8: torch.Tensor) -> torch.Tensor:
    return _quant_linear("fp8", x, w_u8, scale_u8, reference.fp8_linear)


def fp4_linear_impl(x: torch.Tensor, packed_u8: torch.Tensor, scale_u8: torch.Tensor) -> torch.Tensor:
    return _quant_linear("fp4", x, packed_u8, scale_u8, reference.fp4_linear)


# ---------------------------------------------------------------------------------------------------------------
# Custom ops (what a compiled graph calls) and the op-table wrappers

@torch.library.custom_op("deepinfer::host_linear", mutates_args=())
def _linear_op(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return linear_impl(x, weight)


@torch.library.custom_op("deepinfer::host_fp8_linear", mutates_args=())
def _fp8_op(x: torch.Tensor, w_u8: torch.Tensor, scale_u8: torch.Tensor) -> torch.Tensor:
    return fp8_linear_impl(x, w_u8, scale_u8)


@torch.library.custom_op("deepinfer::host_fp4_linear", mutates_args=())
def _fp4_op(x: torch.Tensor, packed_u8: torch.Tensor, scale_u8: torch.Tensor) -> torch.Tensor:
    return fp4_linear_impl(x, packed_u8, scale_u8)


def _fake(x: torch.Tensor, w: torch.Tensor, *_: torch.Tensor) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], w.shape[0]))


for _op in (_linear_op, _fp8_op, _fp4_op):
    _op.register_fake(_fake)


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`reference.linear` with a bf16 weight and fp32 x on the native kernel (see the module docstring)."""
    if weight.dim() != 2 or x.dim() == 0 or x.shape[-1] != weight.shape[-1]:
        return reference.linear(x, weight)  # raises the reference's error
    if weight.dtype == x.dtype:  # BLAS reads the weight once, as it is
        if torch.compiler.is_compiling():
            return reference.linear(x, weight)
        return dispatch.fallback("host.linear", "same dtype", lambda: reference.linear(x, weight))
    if torch.compiler.is_compiling():
        return torch.ops.deepinfer.host_linear(x, weight)
    return linear_impl(x, weight)


def fp8_linear(x: torch.Tensor, w_u8: torch.Tensor, scale_u8: torch.Tensor) -> torch.Tensor:
    """`reference.fp8_linear` on the native kernel (see the module docstring)."""
    n, k = w_u8.shape
    if tuple(scale_u8.shape) != (-(-n // 128), -(-k // 128)) or x.dim() == 0 or x.shape[-1] != k:
        return reference.fp8_linear(x, w_u8, scale_u8)  # raises the reference's ValueError
    if torch.compiler.is_compiling():
        return torch.ops.deepinfer.host_fp8_linear(x, w_u8, scale_u8)
    return fp8_linear_impl(x, w_u8, scale_u8)


def fp4_linear(x: torch.Tensor, packed_u8: torch.Tensor, scale_u8: torch.Tensor) -> torch.Tensor:
    """`reference.fp4_linear` on the native kernel (see the module docstring)."""
    n, k = packed_u8.shape[0], packed_u8.shape[1] * 2
    if k % 32 or tuple(scale_u8.shape) != (n, k // 32) or x.dim() == 0 or x.shape[-1] != k:
        return reference.fp4_linear(x, packed_u8, scale_u8)  # raises the reference's ValueError
    if torch.compiler.is_compiling():
        return torch.ops.deepinfer.host_fp4_linear(x, packed_u8, scale_u8)
    return fp4_linear_impl(x, packed_u8, scale_u8)



def stack_linear_impl(x: torch.Tensor, stack: torch.Tensor, scales: torch.Tensor | None, i: torch.Tensor,
                      fmt: str | None) -> torch.Tensor:
    """The reference table's `stack_linear` (engine/model/ops.py) on the host's GEMMs, reading expert i's weight
    where it lies in the stack (the index is a CPU tensor: reading it costs nothing) instead of gathering a copy."""
    e = int(i.reshape(-1)[0])
    if fmt is None:
        return linear(x, stack[e])
    return (fp8_linear if fmt == "fp8" else fp4_linear)(x, stack[e], scales[e])



stack_linear = _native_op("stack_linear", stack_linear_impl,
                          lambda x, stack, scales, i, fmt: x.new_empty((*x.shape[:-1], stack.shape[1])))
