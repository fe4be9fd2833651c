"""mHC collapse: `x_in[t] = sum_j pre[t, j] * X[t, j]`, the input of each sublayer.

IO layout
    x    [T, n, D] HBM, fp32 or bf16 (the n residual streams; tokens on partitions, D chunks on the free axis)
    pre  [T, n]    HBM fp32 (from `hc_mixes`); column j is a [P,1] fp32 scalar operand of the Vector Engine
    out  [T, D]    shared HBM, dtype of x
Precision
    fp32 products and sums in stream order j = 0..n-1 (as the reference), one rounding to x.dtype.
Constraints
    Any T and D (partial tiles); n <= 16.
Tunables
    `D_CHUNK` = 2048 (n + 2 live fp32 tiles of 8 KiB per partition).
"""

from __future__ import annotations

import torch

from nki_kernels import _convert, dispatch
from nki_kernels._nki import nisa, nki, nl
from nki_kernels.cases import Case, CaseRun, case, gen_for, randn, timed

NAME = "hc_collapse"
D_CHUNK = 2048


@nki.jit
def hc_collapse_kernel(x, pre):
    num_t = x.shape[0]
    num_s = x.shape[1]
    num_d = x.shape[2]
    out = nl.ndarray((num_t, num_d), dtype=x.dtype, buffer=nl.shared_hbm)
    for t0 in range(0, num_t, 128):
        tp = min(128, num_t - t0)
        pre_t = nl.ndarray((tp, num_s), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(pre_t, pre[t0:t0 + tp, 0:num_s])
        for d0 in range(0, num_d, 2048):
            dw = min(2048, num_d - d0)
            acc = nl.ndarray((tp, dw), dtype=nl.float32, buffer=nl.sbuf)
            for j in range(num_s):
                xj = nl.ndarray((tp, dw), dtype=nl.float32, buffer=nl.sbuf)
                nisa.dma_copy(xj, x[t0:t0 + tp, j:j + 1, d0:d0 + dw])
                if j == 0:
                    nisa.tensor_scalar(acc, xj, nl.multiply, pre_t[0:tp, 0:1])
                else:
                    tmp = nl.ndarray((tp, dw), dtype=nl.float32, buffer=nl.sbuf)
                    nisa.tensor_scalar(tmp, xj, nl.multiply, pre_t[0:tp, j:j + 1])
                    nisa.tensor_tensor(acc, acc, tmp, nl.add)
            o = nl.ndarray((tp, dw), dtype=x.dtype, buffer=nl.sbuf)
            nisa.tensor_copy(o, acc)
            nisa.dma_copy(out[t0:t0 + tp, d0:d0 + dw], o)
    return out


def hc_collapse(x: torch.Tensor, pre: torch.Tensor, *, executor: str | None = None) -> torch.Tensor:
    """x [T, n, D], pre [T, n] -> [T, D] in x.dtype."""
    from nki_kernels import reference

    if x.dim() != 3 or pre.shape != x.shape[:2]:
        raise ValueError(f"hc_collapse: x {tuple(x.shape)} must be [T, n, D] and pre {tuple(pre.shape)} [T, n]")
    if x.dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"hc_collapse: fp32 or bf16 streams only, got {x.dtype}")
    ex, out = dispatch.dispatch(NAME, hc_collapse_kernel, (_convert.to_np(x), _convert.to_np(pre.float())),
                                executor, reference=lambda: reference.hc_collapse(x, pre))
    return out if ex == "reference" else _convert.from_np(out)


CASES: list[Case] = []
for _dt in ("float32", "bfloat16"):
    CASES += [
        case(NAME, "tiny-model T=8 n=4 D=128", _dt, t=8, n=4, d=128),
        case(NAME, "tile edge T=129 n=4 D=200", _dt, t=129, n=4, d=200),
        case(NAME, "n=2 T=5 D=64", _dt, t=5, n=2, d=64),
        case(NAME, "V4 T=64 n=4 D=4096", _dt, t=64, n=4, d=4096),
        case(NAME, "V4 T=256 n=4 D=4096", _dt, slow=True, t=256, n=4, d=4096),
    ]


def run_case(c: Case, executor: str) -> CaseRun:
    from nki_kernels import reference

    p, g = c.p, gen_for(c)
    x = randn((p["t"], p["n"], p["d"]), g, c.torch_dtype)
    pre = torch.rand(p["t"], p["n"], generator=g) + 1e-6
    y, ms = timed(lambda: hc_collapse(x, pre, executor=executor))
    want = reference.hc_collapse(x.float(), pre)
    return CaseRun(f"x[{p['t']},{p['n']},{p['d']}] pre[{p['t']},{p['n']}]", [y], [want],
                   dispatch.resolve_executor(executor), ms)
