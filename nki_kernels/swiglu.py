"""SwiGLU with the V4 clamps: `silu(min(gate, limit)) * clamp(up, -limit, limit)`.

IO layout
    gate, up [T, F] HBM, fp32 or bf16 (tokens on partitions, 128 per tile; F on the free axis in chunks)
    out      [T, F] shared HBM, dtype of gate (the next GEMM reads it; the reference returns fp32)
Precision
    fp32 engine math (clamps, SiLU on the Scalar Engine, product); one rounding to gate.dtype on the product.
Constraints
    Any T, F (partial tiles at both edges). `limit <= 0` disables the clamps (compile-time branch).
Tunables
    `F_CHUNK` (2048 elements per partition per tile: 8 KiB fp32, four live tiles).
"""

from __future__ import annotations

import torch

from nki_kernels import _convert, dispatch
from nki_kernels._nki import nisa, nki, nl
from nki_kernels.cases import Case, CaseRun, case, gen_for, randn, timed

NAME = "swiglu"
F_CHUNK = 2048


@nki.jit
def swiglu_kernel(gate, up, limit):
    num_t = gate.shape[0]
    num_f = gate.shape[1]
    out = nl.ndarray((num_t, num_f), dtype=gate.dtype, buffer=nl.shared_hbm)
    for t0 in range(0, num_t, 128):
        tp = min(128, num_t - t0)
        for f0 in range(0, num_f, 2048):
            fw = min(2048, num_f - f0)
            g = nl.ndarray((tp, fw), dtype=nl.float32, buffer=nl.sbuf)
            u = nl.ndarray((tp, fw), dtype=nl.float32, buffer=nl.sbuf)
            nisa.dma_copy(g, gate[t0:t0 + tp, f0:f0 + fw])
            nisa.dma_copy(u, up[t0:t0 + tp, f0:f0 + fw])
            if limit > 0:
                nisa.tensor_scalar(g, g, nl.minimum, limit)
                nisa.tensor_scalar(u, u, nl.maximum, -limit, op1=nl.minimum, operand1=limit)
            s = nl.ndarray((tp, fw), dtype=nl.float32, buffer=nl.sbuf)
            nisa.activation(s, nl.silu, g)
            o = nl.ndarray((tp, fw), dtype=gate.dtype, buffer=nl.sbuf)
            nisa.tensor_tensor(o, s, u, nl.multiply)
            nisa.dma_copy(out[t0:t0 + tp, f0:f0 + fw], o)
    return out


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float, *, executor: str | None = None) -> torch.Tensor:
    """gate, up [..., F] -> [..., F] in gate.dtype (kernel) or fp32 (reference path, as `reference.swiglu`)."""
    from nki_kernels import reference

    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"swiglu: gate {tuple(gate.shape)}/{gate.dtype} and up {tuple(up.shape)}/{up.dtype} differ")
    if gate.dtype not in (torch.float32, torch.bfloat16):
        raise TypeError(f"swiglu: fp32 or bf16 only, got {gate.dtype}")
    lead, f = gate.shape[:-1], gate.shape[-1]
    g2, u2 = gate.reshape(-1, f), up.reshape(-1, f)
    ex, out = dispatch.dispatch(NAME, swiglu_kernel, (_convert.to_np(g2), _convert.to_np(u2), float(limit)),
                                executor, reference=lambda: reference.swiglu(g2, u2, limit))
    y = out if ex == "reference" else _convert.from_np(out)
    return y.reshape(*lead, f)


CASES: list[Case] = []
for _dt in ("float32", "bfloat16"):
    CASES += [
        case(NAME, "tiny-model T=16 F=64", _dt, t=16, f=64, limit=10.0),
        case(NAME, "tile edge T=130 F=300", _dt, t=130, f=300, limit=10.0),
        case(NAME, "no clamp T=7 F=96", _dt, t=7, f=96, limit=0.0),
        case(NAME, "tight clamp T=64 F=256", _dt, t=64, f=256, limit=1.5),
        case(NAME, "V4 expert T=128 F=1024", _dt, t=128, f=1024, limit=10.0),
        case(NAME, "V4 shared T=256 F=2048", _dt, t=256, f=2048, limit=10.0),
        case(NAME, "V4 prefill T=1024 F=2048", _dt, slow=True, t=1024, f=2048, limit=10.0),
    ]


def run_case(c: Case, executor: str) -> CaseRun:
    from nki_kernels import reference

    p, g = c.p, gen_for(c)
    gate = randn((p["t"], p["f"]), g, c.torch_dtype, scale=6.0)  # reaches past the clamp
    up = randn((p["t"], p["f"]), g, c.torch_dtype, scale=6.0)
    y, ms = timed(lambda: swiglu(gate, up, p["limit"], executor=executor))
    want = reference.swiglu(gate.float(), up.float(), p["limit"])
    return CaseRun(f"gate,up[{p['t']},{p['f']}] limit={p['limit']}", [y], [want],
                   dispatch.resolve_executor(executor), ms)
