"""RMSNorm: `y = x * rsqrt(mean(x^2) + eps) * w`, one token per partition.

IO layout
    x    [T, D] HBM, fp32 or bf16 (row-major; tokens tile onto partitions, 128 at a time, D on the free axis)
    w    [D]    HBM, fp32 or bf16 (broadcast to all partitions once, through a ones-matmul)
    out  [T, D] shared HBM, dtype of x
Precision
    Every engine op computes in fp32; x and w are widened on load; the result is rounded once to x.dtype on the
    final multiply (as the official `RMSNorm.forward`: fp32 math, cast back).
Constraints
    Any T (the last token tile may be partial, e.g. T = 200 -> 128 + 72); D * 4 B * ~4 tiles must fit in one
    SBUF partition (D <= 8192 here; the mHC input norm over n*D = 16384 uses `hc_mixes`, not this kernel).
Tunables
    `TOKENS_PER_TILE` (= partitions, 128). The weight broadcast is hoisted out of the token loop.
"""

from __future__ import annotations

import torch

from nki_kernels import _convert, dispatch
from nki_kernels._nki import nisa, nki, nl
from nki_kernels._tiles import load_bcast
from nki_kernels.cases import Case, CaseRun, case, gen_for, randn, timed

NAME = "rmsnorm"
TOKENS_PER_TILE = 128
MAX_D = 8192


@nki.jit
def rmsnorm_kernel(x, w, eps):
    num_t = x.shape[0]
    num_d = x.shape[1]
    out = nl.ndarray((num_t, num_d), dtype=x.dtype, buffer=nl.shared_hbm)
    ones = nl.ndarray((1, 128), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(ones, 1.0)
    w_b = nl.ndarray((128, num_d), dtype=nl.float32, buffer=nl.sbuf)
    load_bcast(w_b, w.reshape((1, num_d)), ones)
    for t0 in range(0, num_t, 128):
        tp = min(128, num_t - t0)
        xt = nl.ndarray((tp, num_d), dtype=nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(xt, x[t0:t0 + tp, 0:num_d])
        sq = nl.ndarray((tp, num_d), dtype=nl.float32, buffer=nl.sbuf)
        ssum = nl.ndarray((tp, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.activation(sq, nl.square, xt, reduce_op=nl.add, reduce_res=ssum,
                        reduce_cmd=nisa.reduce_cmd.reset_reduce)
        rstd = nl.ndarray((tp, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar(rstd, ssum, nl.multiply, 1.0 / num_d, op1=nl.add, operand1=eps)
        nisa.activation(rstd, nl.rsqrt, rstd)
        y = nl.ndarray((tp, num_d), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar(y, xt, nl.multiply, rstd)
        yo = nl.ndarray((tp, num_d), dtype=x.dtype, buffer=nl.sbuf)
        nisa.tensor_tensor(yo, y, w_b[0:tp, 0:num_d], nl.multiply)
        nisa.dma_copy(out[t0:t0 + tp, 0:num_d], yo)
    return out


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *, executor: str | None = None) -> torch.Tensor:
    """RMSNorm over the last dim of `x` [..., D] (any leading dims, flattened to tokens)."""
    from nki_kernels import reference

    if x.dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"rmsnorm: x must be fp32 or bf16, got {x.dtype}")
    if weight.shape != (x.shape[-1],):
        raise ValueError(f"rmsnorm: weight {tuple(weight.shape)} must be [{x.shape[-1]}]")
    if x.shape[-1] > MAX_D:
        raise ValueError(f"rmsnorm: D={x.shape[-1]} > {MAX_D} does not fit the SBUF plan")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    ex, out = dispatch.dispatch(NAME, rmsnorm_kernel, (_convert.to_np(x2), _convert.to_np(weight), float(eps)),
                                executor, reference=lambda: reference.rms_norm(x2, weight, eps))
    y = out if ex == "reference" else _convert.from_np(out)
    return y.reshape(*lead, x.shape[-1])


# ---- cases --------------------------------------------------------------------------------------
CASES: list[Case] = []
for _dt in ("float32", "bfloat16"):
    CASES += [
        case(NAME, "tiny-model T=16 D=128", _dt, t=16, d=128),
        case(NAME, "tile edge T=200 D=384", _dt, t=200, d=384),
        case(NAME, "odd T=1 D=96", _dt, t=1, d=96),
        case(NAME, "q_norm T=130 D=1024", _dt, t=130, d=1024),
        case(NAME, "kv_norm T=64 D=512", _dt, t=64, d=512),
        case(NAME, "V4 hidden T=128 D=4096", _dt, t=128, d=4096),
        case(NAME, "V4 hidden T=512 D=4096", _dt, slow=True, t=512, d=4096),
    ]


def run_case(c: Case, executor: str) -> CaseRun:
    from nki_kernels import reference

    p, g, dt = c.p, gen_for(c), c.torch_dtype
    x = randn((p["t"], p["d"]), g, dt, scale=3.0)
    w = randn((p["d"],), g, dt, scale=0.5) + 1.0
    y, ms = timed(lambda: rmsnorm(x, w, 1e-6, executor=executor))
    want = reference.rms_norm(x.float(), w.float(), 1e-6)
    return CaseRun(f"x[{p['t']},{p['d']}] w[{p['d']}]", [y], [want], dispatch.resolve_executor(executor), ms)
