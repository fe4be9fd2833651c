"""Native host ops of the attention's per-token tail (engine/host_kernels `NATIVE_OPS`; the library is the one
`engine.host_kernels` loads):

    op (reference.<op>)   native when                                              dispatch key
    rope_tail             x fp32 [T, D] / [T, H, D], cos / sin fp32 [T, rd/2] (or    "host.rope_tail"
                          [T, 1, rd/2]), T <= max_m("mhc")
    grouped_out_proj      o fp32 [T, G*Kg], wo_a bf16 [G*R, Kg], T <= max_m("linear")  "host.grouped_out_proj"
    attn_qkv_native       x fp32 [T, dim], wq_a / wq_b / wkv FP8, FP4 or bf16, norms   "host.attn_qkv"
                          and cos / sin fp32, T <= max_m of "mhc" and each weight's
                          format (else None: the table's attn_qkv runs op by op)

`rope_tail` (mhc.c `dk_rope_tail`) is the reference bit for bit (no FMA contraction); at decode sizes it is ~15 torch
ops (~50 us) per call, five calls a layer. `grouped_out_proj` (gemv.c `dk_bf16_grouped_linear`) runs V4's wo_a
(held as bf16 under `--weights stored`: engine/loader.py) on the bf16 GEMV kernel, one call for every group, where
the reference widens the weight to fp32 and runs a batched matmul: results differ by fp32 summation order only.
`attn_qkv_native` (attn.c `dk_attn_qkv`) is the attention's front, engine/model/ops.py `attn_qkv` (three GEMVs, two
norms, the per-head RMS, two RoPEs), as one native call over the same kernels in the same order: the op-by-op host
path's numbers bit for bit, without its eight op-table calls per layer.
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
    y = torch.empty(*x.shape, dtype=hk.F32)
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
    y = torch.empty(t, wo_a.shape[0], dtype=hk.F32)
    rc = hk._native().lib.dk_bf16_grouped_linear(of.data_ptr(), w.data_ptr(), y.data_ptr(), t, g, wo_a.shape[0] // g,
                                                 wo_a.shape[1], torch.get_num_threads())
    if rc != 0:
        raise MemoryError(f"host kernel grouped_out_proj: out of memory for o [{t}, {o.shape[1]}]")
    return y


rope_tail = hk._native_op("rope_tail", rope_tail_impl,
                          lambda x, cos, sin, rd, inverse=False: torch.empty_like(x))
grouped_out_proj = hk._native_op("grouped_out_proj", grouped_out_proj_impl,
                                 lambda o, wo_a, groups: o.new_empty(o.shape[0], wo_a.shape[0]))


def _gemm_args(lin: torch.nn.Module) -> tuple[int, int, int, str] | None:
    """(format code, weight pointer, scale pointer, max_m key) of a Linear the native GEMVs take, else None."""
    fmt, w = lin.fmt, lin.weight
    if fmt is None:
        if w.dtype is not torch.bfloat16 or not w.is_contiguous() or not w.is_cpu:
            return None
        return hk._FMT_CODE[None], w.data_ptr(), 0, hk._FMT_KEY[None]
    s = lin.scale
    if w.dtype is not torch.uint8 or s.dtype is not torch.uint8 or not (w.is_contiguous() and s.is_contiguous()) \
            or not (w.is_cpu and s.is_cpu):
        return None
    return hk._FMT_CODE[fmt], w.data_ptr(), s.data_ptr(), hk._FMT_KEY[fmt]


def attn_qkv_native(x: torch.Tensor, wq_a: torch.nn.Module, q_norm_w: torch.Tensor, wq_b: torch.nn.Module,
                    wkv: torch.nn.Module, kv_norm_w: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_heads: int,
                    rd: int, eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """engine/model/ops.py `attn_qkv` as one native call (attn.c), or None where the op-by-op path must run: not fp32
    CPU inputs, a weight the native GEMVs do not take, more rows than a kernel's max_m, autograd (counted by reason
    under "host.attn_qkv")."""
    t = x.shape[0] if x.dim() == 2 else 0
    why = hk._why_not_rows("mhc", t, x, q_norm_w, kv_norm_w, cos, sin)
    if why is None and (x.dtype is not torch.float32 or cos.dtype is not torch.float32
                        or sin.dtype is not torch.float32 or q_norm_w.dtype is not torch.float32
                        or kv_norm_w.dtype is not torch.float32):
        why = "dtype"
    args = [] if why else [_gemm_args(lin) for lin in (wq_a, wq_b, wkv)]
    if why is None and any(a is None for a in args):
        why = "weight"
    if why is None:
        dim, ql, hd = x.shape[1], wq_a.out_features, wkv.out_features
        if (wq_a.in_features, wq_b.in_features, wq_b.out_features, wkv.in_features) != (dim, ql, n_heads * hd, dim) \
                or tuple(q_norm_w.shape) != (ql,) or tuple(kv_norm_w.shape) != (hd,) or not 0 < rd <= hd or rd % 2 \
                or tuple(cos.shape) != (t, rd // 2) or tuple(sin.shape) != (t, rd // 2):
            why = "shape"
        elif t > (limit := min(hk.max_m(a[3]) for a in args)):
            why = f"M > {limit}"
    if why is not None:
        return dispatch.fallback("host.attn_qkv", why, lambda: None)
    hk._count("host.attn_qkv")
    xf, qn, kn, cf, sf = x.contiguous(), q_norm_w.contiguous(), kv_norm_w.contiguous(), cos.contiguous(), \
        sin.contiguous()
    qr, q = torch.empty(t, ql, dtype=hk.F32), torch.empty(t, n_heads, hd, dtype=hk.F32)
    kv = torch.empty(t, hd, dtype=hk.F32)
    (fa, wa, sa, _), (fb, wb, sb, _), (fk, wk, sk, _) = args
    rc = hk._native().lib.dk_attn_qkv(xf.data_ptr(), t, dim, fa, wa, sa, qn.data_ptr(), ql, fb, wb, sb, n_heads, hd,
                                      fk, wk, sk, kn.data_ptr(), cf.data_ptr(), sf.data_ptr(), rd, eps, qr.data_ptr(),
                                      q.data_ptr(), kv.data_ptr(), torch.get_num_threads())
    if rc != 0:
        raise MemoryError(f"host kernel attn_qkv: error {rc} for x [{t}, {dim}]")
    return q, kv, qr
