"""Attention tail fused with the mHC expand: `hc_expand(o @ wo_b^T, residual, post, comb)`.

The grouped `wo_a` (see `blockquant.grouped_out_proj`) produces o [T, G*R]; this kernel runs `wo_b` and mixes the
result straight into the n residual streams, so y [T, D] never goes back to HBM.

IO layout
    o         [T, K]     HBM fp32/bf16, K = G*R (tokens on partitions; K is moved onto partitions with PE
                         transposes, 128 x 128 at a time)
    wo_bT     [K, D]     HBM, same dtype class as o: `wo_b` [D, K] stored K-major (the wrapper's layout adapter
                         transposes; a loader would store it that way once)
    residual  [T, n, D]  HBM, dtype of o;  post [T, n] fp32;  comb [T, n, n] fp32
    out       [T, n, D]  shared HBM, dtype of o
Precision
    bf16 x bf16 (or fp32 x fp32) products, fp32 PSUM accumulation over K; y is rounded to o.dtype (as
    `reference.linear`), then the expand runs in fp32 with one rounding to o.dtype.
Constraints
    Any T, K, D (partial tiles); matmul tiles: stationary o^T [<=128, tp<=128], moving [<=128, <=512].
Tunables
    `D_CHUNK` = 512 (one PSUM bank of fp32 per partition).
"""

from __future__ import annotations

import torch

from nki_kernels import _convert, dispatch
from nki_kernels._nki import nisa, nki, nl
from nki_kernels._tiles import expand_tile, load_xT, matmul_rows
from nki_kernels.cases import Case, CaseRun, case, gen_for, randn, timed
from nki_kernels.hc_expand import make_mix

NAME = "hc_attn_out"
D_CHUNK = 512


@nki.jit
def hc_attn_out_kernel(o, wo_bT, residual, post, comb):
    num_t = o.shape[0]
    num_k = o.shape[1]
    num_d = wo_bT.shape[1]
    num_s = residual.shape[1]
    out = nl.ndarray((num_t, num_s, num_d), dtype=o.dtype, buffer=nl.shared_hbm)
    for t0 in range(0, num_t, 128):
        tp = min(128, num_t - t0)
        post_t = nl.ndarray((tp, num_s), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(post_t, post[t0:t0 + tp, 0:num_s])
        comb_t = nl.ndarray((tp, num_s * num_s), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(comb_t, comb[t0:t0 + tp, 0:num_s, 0:num_s])
        xT = nl.ndarray((128, (num_k + 127) // 128, tp), dtype=o.dtype, buffer=nl.sbuf)
        load_xT(xT, o, t0, tp, 0, num_k, 0, o.dtype)
        for d0 in range(0, num_d, 512):
            dw = min(512, num_d - d0)
            ps = nl.ndarray((tp, dw), dtype=nl.float32, buffer=nl.psum)
            matmul_rows(ps, xT, wo_bT, 0, num_k, d0, dw)
            yt = nl.ndarray((tp, dw), dtype=o.dtype, buffer=nl.sbuf)
            nisa.tensor_copy(yt, ps)
            xs = nl.ndarray((tp, num_s, dw), dtype=nl.float32, buffer=nl.sbuf)
            nisa.dma_copy(xs, residual[t0:t0 + tp, 0:num_s, d0:d0 + dw])
            expand_tile(out, t0, d0, yt, xs, post_t, comb_t)
    return out


def hc_attn_out(o: torch.Tensor, wo_b: torch.Tensor, residual: torch.Tensor, post: torch.Tensor,
                comb: torch.Tensor, *, executor: str | None = None) -> torch.Tensor:
    """o [T, G*R], wo_b [D, G*R] (dense, already dequantised), residual [T, n, D] -> [T, n, D] in o.dtype."""
    from nki_kernels import reference

    t, n, d = residual.shape
    if o.dim() != 2 or wo_b.shape != (d, o.shape[1]) or o.shape[0] != t:
        raise ValueError(f"hc_attn_out: o {tuple(o.shape)} [T,K], wo_b {tuple(wo_b.shape)} [D,K], "
                         f"residual {tuple(residual.shape)} [T,n,D] disagree")
    if post.shape != (t, n) or comb.shape != (t, n, n) or residual.dtype != o.dtype:
        raise ValueError("hc_attn_out: post [T,n] / comb [T,n,n] / residual dtype mismatch")
    wT = wo_b.to(o.dtype).t().contiguous()  # layout adapter: K-major weight for the moving operand
    args = (_convert.to_np(o), _convert.to_np(wT), _convert.to_np(residual), _convert.to_np(post.float()),
            _convert.to_np(comb.float()))
    ex, out = dispatch.dispatch(NAME, hc_attn_out_kernel, args, executor,
                                reference=lambda: reference.hc_attn_out(o, wo_b, residual, post, comb))
    return out if ex == "reference" else _convert.from_np(out)


CASES: list[Case] = []
for _dt in ("float32", "bfloat16"):
    CASES += [
        case(NAME, "tiny-model T=8 K=64 D=128 n=4", _dt, t=8, k=64, d=128, n=4),
        case(NAME, "tile edge T=130 K=200 D=600 n=4", _dt, t=130, k=200, d=600, n=4),
        case(NAME, "V4 K, D slice T=16 K=8192 D=1024 n=4", _dt, t=16, k=8192, d=1024, n=4),
        case(NAME, "V4 decode T=16 K=8192 D=4096 n=4", _dt, slow=True, t=16, k=8192, d=4096, n=4),
        case(NAME, "V4 prefill T=128 K=8192 D=4096 n=4", _dt, slow=True, t=128, k=8192, d=4096, n=4),
    ]


def run_case(c: Case, executor: str) -> CaseRun:
    from nki_kernels import reference

    p, g, dt = c.p, gen_for(c), c.torch_dtype
    t, k, d, n = p["t"], p["k"], p["d"], p["n"]
    o = randn((t, k), g, dt)
    wo_b = randn((d, k), g, dt, scale=k ** -0.5)
    res = randn((t, n, d), g, dt)
    post, comb = make_mix(t, n, g)
    y, ms = timed(lambda: hc_attn_out(o, wo_b, res, post, comb, executor=executor))
    # reference in o's dtype: y = linear(o, wo_b) is rounded to bf16 there, exactly as the kernel rounds it
    want = reference.hc_attn_out(o, wo_b, res, post, comb).float()
    return CaseRun(f"o[{t},{k}] wo_b[{d},{k}] X[{t},{n},{d}]", [y], [want], dispatch.resolve_executor(executor), ms)
