"""mHC mixing weights of one site: projection + RMS scale + gates + Sinkhorn.

    mix  = (fn @ v) * rsqrt(mean(v^2) + norm_eps),  v = flatten(X) in fp32            [T, (2+n)*n]
    pre  = sigmoid(scale0 * mix[:n] + base[:n]) + hc_eps;  post = 2 * sigmoid(scale1 * mix[n:2n] + base[n:2n])
    comb = softmax_k(scale2 * mix[2n:] + base[2n:]) + hc_eps, a column normalisation, then (iters - 1) x
           (row, column) normalisations, each dividing by (sum + hc_eps)

IO layout
    x      [T, n*D]   HBM fp32/bf16 (streams flattened); tokens on partitions for the sum of squares, and moved
                      to K-on-partitions (128 x 128 PE transposes, widened to fp32) for the projection
    fnT    [n*D, M]   HBM fp32, M = (2+n)*n: `fn` [M, n*D] stored K-major (wrapper layout adapter)
    scale  [3], base [M]  HBM fp32, broadcast to all partitions with a ones-matmul
    outs   pre [T, n], post [T, n], comb [T, n, n]: shared HBM fp32
Precision
    fp32 throughout (as the reference): fp32 x fp32 matmul with fp32 PSUM; divisions are reciprocal + multiply
    (the engines have no divide), so results differ from torch by a few ulps.
Constraints
    Any T, D (partial tiles); M <= 512 (one PSUM bank); n <= 8. Sinkhorn runs per token on [n, n] free-axis
    tiles: row sums are trailing-axis reductions, column sums are n-1 row-tile additions.
Tunables
    `SQ_CHUNK` = 2048 (sum-of-squares chunk), iterations are unrolled at compile time.
"""

from __future__ import annotations

import torch

from nki_kernels import _convert, dispatch
from nki_kernels._nki import nisa, nki, nl
from nki_kernels._tiles import load_bcast, load_xT, matmul_rows
from nki_kernels.cases import Case, CaseRun, case, gen_for, randn, timed

NAME = "hc_mixes"
SQ_CHUNK = 2048


@nki.jit
def hc_mixes_kernel(x, fnT, scale, base, hc_mult, iters, hc_eps, norm_eps):
    num_t = x.shape[0]
    num_k = x.shape[1]
    num_m = fnT.shape[1]
    n = hc_mult
    pre = nl.ndarray((num_t, n), dtype=nl.float32, buffer=nl.shared_hbm)
    post = nl.ndarray((num_t, n), dtype=nl.float32, buffer=nl.shared_hbm)
    comb = nl.ndarray((num_t, n, n), dtype=nl.float32, buffer=nl.shared_hbm)
    ones = nl.ndarray((1, 128), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(ones, 1.0)
    sc_b = nl.ndarray((128, 3), dtype=nl.float32, buffer=nl.sbuf)
    load_bcast(sc_b, scale.reshape((1, 3)), ones)
    base_b = nl.ndarray((128, num_m), dtype=nl.float32, buffer=nl.sbuf)
    load_bcast(base_b, base.reshape((1, num_m)), ones)
    for t0 in range(0, num_t, 128):
        tp = min(128, num_t - t0)
        # RMS of the flattened streams
        ssum = nl.ndarray((tp, 1), dtype=nl.float32, buffer=nl.sbuf)
        for k0 in range(0, num_k, 2048):
            kw = min(2048, num_k - k0)
            xc = nl.ndarray((tp, kw), dtype=nl.float32, buffer=nl.sbuf)
            nisa.dma_copy(xc, x[t0:t0 + tp, k0:k0 + kw])
            sq = nl.ndarray((tp, kw), dtype=nl.float32, buffer=nl.sbuf)
            part = nl.ndarray((tp, 1), dtype=nl.float32, buffer=nl.sbuf)
            nisa.activation(sq, nl.square, xc, reduce_op=nl.add, reduce_res=part,
                            reduce_cmd=nisa.reduce_cmd.reset_reduce)
            if k0 == 0:
                nisa.tensor_copy(ssum, part)
            else:
                nisa.tensor_tensor(ssum, ssum, part, nl.add)
        rstd = nl.ndarray((tp, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar(rstd, ssum, nl.multiply, 1.0 / num_k, op1=nl.add, operand1=norm_eps)
        nisa.activation(rstd, nl.rsqrt, rstd)
        # projection: mix = (x @ fn^T) * rstd
        xT = nl.ndarray((128, (num_k + 127) // 128, tp), dtype=nl.float32, buffer=nl.sbuf)
        load_xT(xT, x, t0, tp, 0, num_k, 0, nl.float32)
        ps = nl.ndarray((tp, num_m), dtype=nl.float32, buffer=nl.psum)
        matmul_rows(ps, xT, fnT, 0, num_k, 0, num_m)
        mix = nl.ndarray((tp, num_m), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar(mix, ps, nl.multiply, rstd)
        # gates
        for gi in range(2):
            a = nl.ndarray((tp, n), dtype=nl.float32, buffer=nl.sbuf)
            nisa.tensor_scalar(a, mix[0:tp, gi * n:gi * n + n], nl.multiply, sc_b[0:tp, gi:gi + 1])
            nisa.tensor_tensor(a, a, base_b[0:tp, gi * n:gi * n + n], nl.add)
            nisa.activation(a, nl.sigmoid, a)
            g_out = nl.ndarray((tp, n), dtype=nl.float32, buffer=nl.sbuf)
            if gi == 0:
                nisa.tensor_scalar(g_out, a, nl.add, hc_eps)
                nisa.dma_copy(pre[t0:t0 + tp, 0:n], g_out)
            else:
                nisa.tensor_scalar(g_out, a, nl.multiply, 2.0)
                nisa.dma_copy(post[t0:t0 + tp, 0:n], g_out)
        # comb logits -> row softmax + eps
        c = nl.ndarray((tp, n * n), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar(c, mix[0:tp, 2 * n:2 * n + n * n], nl.multiply, sc_b[0:tp, 2:3])
        nisa.tensor_tensor(c, c, base_b[0:tp, 2 * n:2 * n + n * n], nl.add)
        c3 = c.reshape((tp, n, n))
        negmax = nl.ndarray((tp, n), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_reduce(negmax, nl.maximum, c3, axis=(2,), negate=True)
        rsum = nl.ndarray((tp, n), dtype=nl.float32, buffer=nl.sbuf)
        for j in range(n):
            nisa.activation(c3[0:tp, j, 0:n], nl.exp, c3[0:tp, j, 0:n], bias=negmax[0:tp, j:j + 1],
                            reduce_op=nl.add, reduce_res=rsum[0:tp, j:j + 1], reduce_cmd=nisa.reduce_cmd.reset_reduce)
        rinv = nl.ndarray((tp, n), dtype=nl.float32, buffer=nl.sbuf)
        nisa.reciprocal(rinv, rsum)
        for j in range(n):
            nisa.tensor_scalar(c3[0:tp, j, 0:n], c3[0:tp, j, 0:n], nl.multiply, rinv[0:tp, j:j + 1],
                               op1=nl.add, operand1=hc_eps)
        # Sinkhorn: one column normalisation, then (iters - 1) x (rows, columns)
        csum = nl.ndarray((tp, n), dtype=nl.float32, buffer=nl.sbuf)
        cinv = nl.ndarray((tp, n), dtype=nl.float32, buffer=nl.sbuf)
        for it in range(2 * iters - 1):
            if it % 2 == 1:  # rows
                nisa.tensor_reduce(rsum, nl.add, c3, axis=(2,))
                nisa.tensor_scalar(rsum, rsum, nl.add, hc_eps)
                nisa.reciprocal(rinv, rsum)
                for j in range(n):
                    nisa.tensor_scalar(c3[0:tp, j, 0:n], c3[0:tp, j, 0:n], nl.multiply, rinv[0:tp, j:j + 1])
            else:  # columns
                nisa.tensor_copy(csum, c3[0:tp, 0, 0:n])
                for j in range(1, n):
                    nisa.tensor_tensor(csum, csum, c3[0:tp, j, 0:n], nl.add)
                nisa.tensor_scalar(csum, csum, nl.add, hc_eps)
                nisa.reciprocal(cinv, csum)
                for j in range(n):
                    nisa.tensor_tensor(c3[0:tp, j, 0:n], c3[0:tp, j, 0:n], cinv, nl.multiply)
        nisa.dma_copy(comb[t0:t0 + tp, 0:n, 0:n], c3)
    return pre, post, comb


def hc_mixes(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, hc_mult: int, iters: int,
             hc_eps: float, norm_eps: float, *, executor: str | None = None
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [T, n, D] streams -> (pre [T, n], post [T, n], comb [T, n, n]) fp32, as `reference.hc_mixes`."""
    from nki_kernels import reference

    n = hc_mult
    m = (2 + n) * n
    if x.dim() != 3 or x.shape[1] != n:
        raise ValueError(f"hc_mixes: x {tuple(x.shape)} must be [T, {n}, D]")
    if fn.shape != (m, x.shape[1] * x.shape[2]) or scale.shape != (3,) or base.shape != (m,):
        raise ValueError(f"hc_mixes: fn {tuple(fn.shape)} [M, nD], scale {tuple(scale.shape)} [3], "
                         f"base {tuple(base.shape)} [M] with M = {m}")
    if iters < 1:
        raise ValueError("hc_mixes: iters >= 1")
    x2 = x.reshape(x.shape[0], -1)
    fnT = fn.float().t().contiguous()  # layout adapter: K-major for the moving operand
    args = (_convert.to_np(x2), _convert.to_np(fnT), _convert.to_np(scale.float()), _convert.to_np(base.float()),
            int(n), int(iters), float(hc_eps), float(norm_eps))
    ex, out = dispatch.dispatch(NAME, hc_mixes_kernel, args, executor,
                                reference=lambda: reference.hc_mixes(x, fn, scale, base, n, iters, hc_eps, norm_eps))
    return out if ex == "reference" else tuple(_convert.from_np(a) for a in out)


CASES: list[Case] = []
for _dt in ("float32", "bfloat16"):
    CASES += [
        case(NAME, "tiny-model T=8 n=4 D=128 iters=20", _dt, t=8, n=4, d=128, iters=20),
        case(NAME, "tile edge T=130 n=4 D=50 iters=3", _dt, t=130, n=4, d=50, iters=3),
        case(NAME, "n=2 T=5 D=64 iters=1", _dt, t=5, n=2, d=64, iters=1),
        case(NAME, "V4 T=16 n=4 D=4096 iters=20", _dt, t=16, n=4, d=4096, iters=20),
        case(NAME, "V4 T=128 n=4 D=4096 iters=20", _dt, slow=True, t=128, n=4, d=4096, iters=20),
    ]


def run_case(c: Case, executor: str) -> CaseRun:
    from nki_kernels import reference

    p, g = c.p, gen_for(c)
    t, n, d = p["t"], p["n"], p["d"]
    m = (2 + n) * n
    x = randn((t, n, d), g, c.torch_dtype)
    fn = randn((m, n * d), g, scale=(n * d) ** -0.5)
    scale = torch.rand(3, generator=g) + 0.5
    base = randn((m,), g, scale=0.5)
    outs, ms = timed(lambda: hc_mixes(x, fn, scale, base, n, p["iters"], 1e-6, 1e-6, executor=executor))
    want = reference.hc_mixes(x.float(), fn, scale, base, n, p["iters"], 1e-6, 1e-6)
    return CaseRun(f"x[{t},{n},{d}] fn[{m},{n * d}]", list(outs), list(want), dispatch.resolve_executor(executor), ms)
