"""The MoE FFN of a decode step after the gate (moe.c `dk_moe_ffn`: routed experts in expert order plus the shared
expert, over the host GEMMs) as one native call, and as the custom op `deepinfer::host_moe_ffn` in region graphs."""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch

from engine.host_kernels.native import F32, _count, _native, _why_not_rows, max_m
from engine.host_kernels.packs import _FMT_CODE, _FMT_DTYPE, _FMT_KEY
from nki_kernels import dispatch


def _moe_why_not(x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor,
                 parts: list[tuple[str | None, tuple[torch.Tensor | None, ...]]]) -> str | None:
    """Why `moe_ffn` does not take this call natively (None: it does); reads metadata only (works on the fake
    tensors of a graph being traced)."""
    t = x.shape[0] if x.dim() == 2 else 0
    why = _why_not_rows("mhc", t, x, weights, indices)
    if why is None and (x.dtype is not torch.float32 or weights.dtype is not torch.float32
                        or indices.dtype is not torch.int64):
        why = "dtype"
    if why is None and (x.dim() != 2 or weights.shape != indices.shape or indices.dim() != 2
                        or indices.shape[0] != t):
        why = "shape"
    return why if why is not None else _moe_weights_why_not(t, parts)


def _moe_weights_why_not(t: int, parts: list[tuple[str | None, tuple[torch.Tensor | None, ...]]]) -> str | None:
    """`_moe_why_not`'s checks of the expert weights (`parts`: routed, then shared) for t token rows."""
    for fmt, ts in parts:
        if fmt not in _FMT_CODE or ts[0].dtype is not _FMT_DTYPE[fmt] or ts[2].dtype is not _FMT_DTYPE[fmt] \
                or ts[4].dtype is not _FMT_DTYPE[fmt] or any(u is not None and not u.is_contiguous() for u in ts):
            return "dtype"
        if ts[0].shape[-2] != parts[0][1][0].shape[-2]:
            return "shape"
        if t > max_m(_FMT_KEY[fmt]):
            return f"M > {max_m(_FMT_KEY[fmt])}"
    return None


def moe_ffn(x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, limit: float, e_lo: int,
            routed: tuple[str | None, tuple[torch.Tensor | None, ...]],
            shared: tuple[str | None, tuple[torch.Tensor | None, ...]] | None,
            ref: Callable[[], torch.Tensor]) -> torch.Tensor:
    """The MoE FFN of a decode step (engine/model/moe.py `MoE.forward` after the gate: routed experts + shared
    expert) as one native call (moe.c `dk_moe_ffn`), else `ref()` (the module's own op-by-op path), counted by
    reason under "host.moe_ffn". x [T, D] fp32, weights / indices [T, K] (fp32 / int64) -> fp32 [T, D].
    `routed` = (fmt, (w1, s1, w3, s3, w2, s2)): the local experts' stacks [E_local, ...] from expert e_lo on, scales
    None for bf16 weights (fmt None); `shared` the same for the shared expert's [I, D] / [D, I] tensors (None: no
    shared expert). The GEMMs are the ones `linear` / `fp8_linear` / `fp4_linear` run, in the module's order, so
    results equal the op-by-op host path up to silu's exp (libm's expf, within an ulp or two). Inside a graph being
    compiled (decode regions: `MoE.forward_static`) the native call is the custom op `deepinfer::host_moe_ffn`."""
    parts = [routed] + ([shared] if shared is not None else [])
    why = _moe_why_not(x, weights, indices, parts)
    if torch.compiler.is_compiling():  # decided on the traced shapes; counted when the op runs
        if why is not None:
            return ref()
        return torch.ops.deepinfer.host_moe_ffn(x, weights, indices, limit, e_lo, routed[0] or "", list(routed[1]),
                                                shared[0] or "" if shared else "", list(shared[1]) if shared else [])
    if why is not None:
        return dispatch.fallback("host.moe_ffn", why, ref)
    return _moe_ffn_native(x, weights, indices, limit, e_lo, routed, shared)


def _moe_ffn_native(x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, limit: float, e_lo: int,
                    routed: tuple[str | None, tuple[torch.Tensor | None, ...]],
                    shared: tuple[str | None, tuple[torch.Tensor | None, ...]] | None) -> torch.Tensor:
    _count("host.moe_ffn")
    parts = [routed] + ([shared] if shared is not None else [])
    t = x.shape[0]
    fmt_r, rw = routed
    e_n, inter = rw[0].shape[0], rw[0].shape[1]
    d, k = x.shape[1], indices.shape[1]
    xf, wf, idx = x.contiguous(), weights.contiguous(), indices.contiguous()
    y = torch.empty(t, d, dtype=F32)
    ptrs = [(ctypes.c_void_p * 6)(*[u.data_ptr() if u is not None else None for u in ts]) for _, ts in parts]
    rc = _native().lib.dk_moe_ffn(
        xf.data_ptr(), t, d, inter, limit, idx.data_ptr(), wf.data_ptr(), k, e_lo, e_n, _FMT_CODE[fmt_r], ptrs[0],
        _FMT_CODE[shared[0]] if shared is not None else 0, ptrs[1] if shared is not None else None, y.data_ptr(),
        torch.get_num_threads())
    if rc != 0:
        raise MemoryError(f"host kernel moe_ffn: out of memory for x [{t}, {d}]")
    return y


@torch.library.custom_op("deepinfer::host_moe_ffn", mutates_args=())
def _moe_ffn_op(x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, limit: float, e_lo: int, fmt_r: str,
                routed: list[torch.Tensor | None], fmt_s: str, shared: list[torch.Tensor | None]) -> torch.Tensor:
    """`moe_ffn`'s native call in a compiled graph (the caller checked `_moe_why_not` on the traced shapes)."""
    return _moe_ffn_native(x, weights, indices, limit, e_lo, (fmt_r or None, tuple(routed)),
                           (fmt_s or None, tuple(shared)) if shared else None)


_moe_ffn_op.register_fake(lambda x, *_: x.new_empty(x.shape))
