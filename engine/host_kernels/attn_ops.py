"""Native host ops of the attention's per-token tail (engine/host_kernels `NATIVE_OPS`; the library is the one
`engine.host_kernels` loads):

    op (reference.<op>)   native when                                              dispatch key
    rope_tail             x fp32 [T, D] / [T, H, D], cos / sin fp32 [T, rd/2] (or    "host.rope_tail"
                          [T, 1, rd/2]), T <= max_m("mhc")
    grouped_out_proj      o fp32 [T, G*Kg], wo_a bf16 [G*R, Kg], T <= max_m("linear")  "host.grouped_out_proj"

`rope_tail` (mhc.c `dk_rope_tail`) is the reference bit for bit (no FMA contraction); at decode sizes it is ~15 torch
ops (~50 us) per call, five calls a layer. `grouped_out_proj` (gemv.c `dk_bf16_grouped_linear`) runs V4's wo_a
(held as bf16 under `--weights stored`: engine/loader.py) on the bf16 GEMV kernel, one call for every group, where
the reference widens the weight to fp32 and runs a batched matmul: results differ by fp32 summation order only.
Every other case runs the reference, counted by reason (`dispatch.fallbacks()`).
"""

from __future__ import annotations

import torch

from engine import host_kernels as hk
from nki_kernels import dispatch, reference


def rope_tail_impl(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rd: int,
                   inverse: bool = False) -> torch.Tensor:
    """`reference.rope_tail` natively (mhc.c)."""
    def ref():
        return reference.rope_tail(x, cos, sin, rd, inverse)

    t = x.shape[0] if x.dim() in (2, 3) else 0
    why = hk._why_not_rows("mhc", t, x, cos, sin)
    if why is None and (x.dtype is not torch.float32 or cos.dtype is not torch.float32
                        or sin.dtype is not torch.float32):
        why = "dtype"
    if why is None:
        h2 = rd // 2
        want = (t, h2) if x.dim() == 2 else (t, 1, h2)  # one angle per token (for every head)
        if x.dim() not in (2, 3) or not 0 < rd <= x.shape[-1] or rd % 2 or tuple(cos.shape) != want \
                or tuple(sin.shape) != want:
            why = "shape"
    if why is not None:
        return dispatch.fallback("host.rope_tail", why, ref)
    hk._count("host.rope_tail")
    xf, cf, sf = x.contiguous(), cos.contiguous(), sin.contiguous()
    y = torch.empty(x.shape, dtype=torch.float32)
    heads = x.shape[1] if x.dim() == 3 else 1
    hk._native().lib.dk_rope_tail(xf.data_ptr(), cf.data_ptr(), sf.data_ptr(), y.data_ptr(), t, heads, x.shape[-1],
                                  rd, int(bool(inverse)))
    return y


def grouped_out_proj_impl(o: torch.Tensor, wo_a: torch.Tensor, groups: int) -> torch.Tensor:
    """`reference.grouped_out_proj` with a bf16 wo_a natively (gemv.c)."""
    def ref():
        return reference.grouped_out_proj(o, wo_a, groups)

    if o.dim() != 2 or wo_a.dim() != 2 or groups <= 0 or o.shape[1] % groups or wo_a.shape[0] % groups \
            or wo_a.shape[1] * groups != o.shape[1]:
        return ref()  # the reference's behaviour (or error) for odd shapes
    why = hk._why_not("linear", o, wo_a)
    if why is None and (o.dtype is not torch.float32 or wo_a.dtype is not torch.bfloat16):
        why = "dtype"
    if why is not None:
        return dispatch.fallback("host.grouped_out_proj", why, ref)
    hk._count("host.grouped_out_proj")
    t, g = o.shape[0], groups
    of, w = o.contiguous(), wo_a.contiguous()
    y = torch.empty(t, wo_a.shape[0])
    rc = hk._native().lib.dk_bf16_grouped_linear(of.data_ptr(), w.data_ptr(), y.data_ptr(), t, g, wo_a.shape[0] // g,
                                                 wo_a.shape[1], torch.get_num_threads())
    if rc != 0:
        raise MemoryError(f"host kernel grouped_out_proj: out of memory for o [{t}, {o.shape[1]}]")
    return y


rope_tail = hk._native_op("rope_tail", rope_tail_impl,
                          lambda x, cos, sin, rd, inverse=False: torch.empty_like(x))
grouped_out_proj = hk._native_op("grouped_out_proj", grouped_out_proj_impl,
                                 lambda o, wo_a, groups: o.new_empty(o.shape[0], wo_a.shape[0]))
