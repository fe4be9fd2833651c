"""mHC expand + mix: `X'[t, k] = post[t, k] * y[t] + sum_j comb[t, j, k] * X[t, j]`.

Note the transposed use of comb (sum over its first index, the source stream).

IO layout
    y         [T, D]    HBM, fp32 or bf16 (sublayer output; tokens on partitions)
    residual  [T, n, D] HBM, same dtype (the streams before the sublayer)
    post      [T, n]    HBM fp32;  comb [T, n, n] HBM fp32 (loaded as one [T, n*n] tile; column j*n+k)
    out       [T, n, D] shared HBM, dtype of y
Precision
    fp32 math, one rounding to y.dtype per output element.
Constraints
    Any T, D (partial tiles); n <= 8 (n*n fp32 mixing columns per token).
Tunables
    `D_CHUNK` = 1024 (n + 3 live fp32 tiles per partition).
"""

from __future__ import annotations

import torch

from nki_kernels import _convert, dispatch
from nki_kernels._nki import nisa, nki, nl
from nki_kernels._tiles import expand_tile
from nki_kernels.cases import Case, CaseRun, case, gen_for, randn, timed

NAME = "hc_expand"
D_CHUNK = 1024


@nki.jit
def hc_expand_kernel(y, residual, post, comb):
    num_t = residual.shape[0]
    num_s = residual.shape[1]
    num_d = residual.shape[2]
    out = nl.ndarray((num_t, num_s, num_d), dtype=y.dtype, buffer=nl.shared_hbm)
    for t0 in range(0, num_t, 128):
        tp = min(128, num_t - t0)
        post_t = nl.ndarray((tp, num_s), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(post_t, post[t0:t0 + tp, 0:num_s])
        comb_t = nl.ndarray((tp, num_s * num_s), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(comb_t, comb[t0:t0 + tp, 0:num_s, 0:num_s])
        for d0 in range(0, num_d, 1024):
            dw = min(1024, num_d - d0)
            yt = nl.ndarray((tp, dw), dtype=nl.float32, buffer=nl.sbuf)
            nisa.dma_copy(yt, y[t0:t0 + tp, d0:d0 + dw])
            xs = nl.ndarray((tp, num_s, dw), dtype=nl.float32, buffer=nl.sbuf)
            nisa.dma_copy(xs, residual[t0:t0 + tp, 0:num_s, d0:d0 + dw])
            expand_tile(out, t0, d0, yt, xs, post_t, comb_t)
    return out


def check_expand_args(y: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> None:
    t, n, d = residual.shape
    if y.shape != (t, d) or post.shape != (t, n) or comb.shape != (t, n, n):
        raise ValueError(f"hc_expand: y {tuple(y.shape)} [T,D], residual {tuple(residual.shape)} [T,n,D], "
                         f"post {tuple(post.shape)} [T,n], comb {tuple(comb.shape)} [T,n,n] disagree")
    if y.dtype != residual.dtype or y.dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"hc_expand: y and residual must share fp32/bf16, got {y.dtype}/{residual.dtype}")


def hc_expand(y: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, *,
              executor: str | None = None) -> torch.Tensor:
    """y [T, D], residual [T, n, D], post [T, n], comb [T, n, n] -> [T, n, D] in y.dtype."""
    from nki_kernels import reference

    check_expand_args(y, residual, post, comb)
    args = (_convert.to_np(y), _convert.to_np(residual), _convert.to_np(post.float()), _convert.to_np(comb.float()))
    ex, out = dispatch.dispatch(NAME, hc_expand_kernel, args, executor,
                                reference=lambda: reference.hc_expand(y, residual, post, comb))
    return out if ex == "reference" else _convert.from_np(out)


CASES: list[Case] = []
for _dt in ("float32", "bfloat16"):
    CASES += [
        case(NAME, "tiny-model T=8 n=4 D=128", _dt, t=8, n=4, d=128),
        case(NAME, "tile edge T=131 n=4 D=1100", _dt, t=131, n=4, d=1100),
        case(NAME, "n=2 T=3 D=64", _dt, t=3, n=2, d=64),
        case(NAME, "V4 T=64 n=4 D=4096", _dt, t=64, n=4, d=4096),
        case(NAME, "V4 T=256 n=4 D=4096", _dt, slow=True, t=256, n=4, d=4096),
    ]


def make_mix(t: int, n: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    post = 2 * torch.rand(t, n, generator=g)
    comb = torch.rand(t, n, n, generator=g)
    comb = comb / comb.sum(-1, keepdim=True)
    return post, comb


def run_case(c: Case, executor: str) -> CaseRun:
    from nki_kernels import reference

    p, g = c.p, gen_for(c)
    t, n, d = p["t"], p["n"], p["d"]
    y = randn((t, d), g, c.torch_dtype)
    res = randn((t, n, d), g, c.torch_dtype)
    post, comb = make_mix(t, n, g)
    out, ms = timed(lambda: hc_expand(y, res, post, comb, executor=executor))
    want = reference.hc_expand(y.float(), res.float(), post, comb)
    return CaseRun(f"y[{t},{d}] X[{t},{n},{d}] comb[{t},{n},{n}]", [out], [want],
                   dispatch.resolve_executor(executor), ms)
