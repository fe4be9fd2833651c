"""Case matrices: one `Case` per (kernel, shape set, dtype), and the comparison rule shared by every kernel.

A kernel module exposes `CASES: list[Case]` and `run_case(case, executor) -> CaseRun`: it builds seeded inputs,
calls its wrapper on `executor` (timed) and the torch reference (the same function the engine's host path calls),
and returns both. `compare()` turns that into errors and a verdict. No printing, no pandas here.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

TOL = {"float32": (1e-3, 1e-4), "bfloat16": (2e-2, 1e-3)}  # (rtol, atol), AWS style


@dataclass(frozen=True)
class Case:
    kernel: str
    name: str
    dtype: str  # activation dtype: "float32" | "bfloat16"
    params: tuple[tuple[str, Any], ...]
    slow: bool = False
    rtol: float | None = None
    atol: float | None = None

    @property
    def p(self) -> dict[str, Any]:
        return dict(self.params)

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def tol(self) -> tuple[float, float]:
        rtol, atol = TOL[self.dtype]
        return (self.rtol if self.rtol is not None else rtol, self.atol if self.atol is not None else atol)

    @property
    def seed(self) -> int:
        return sum(map(ord, f"{self.kernel}/{self.name}/{self.dtype}")) % (2**31)


def case(kernel: str, name: str, dtype: str, slow: bool = False, rtol: float | None = None,
         atol: float | None = None, **params: Any) -> Case:
    return Case(kernel, name, dtype, tuple(params.items()), slow, rtol, atol)


@dataclass
class CaseRun:
    shapes: str
    got: Sequence[torch.Tensor]
    want: Sequence[torch.Tensor]
    executor: str
    time_ms: float
    extra_ok: bool = True  # kernel-specific structural checks (e.g. top-k indices) passed
    note: str = ""


@dataclass
class Verdict:
    max_abs_err: float
    max_rel_err: float
    ok: bool
    note: str = field(default="")


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    t0 = time.perf_counter()
    out = fn()
    return out, (time.perf_counter() - t0) * 1e3


def compare(run: CaseRun, rtol: float, atol: float) -> Verdict:
    """Pass iff for every output: max|got - want| <= atol + rtol * max|want| (nki-library "max" mode)."""
    max_abs, max_rel, ok = 0.0, 0.0, run.extra_ok
    for g, w in zip(run.got, run.want, strict=True):
        g, w = g.float(), w.float()
        if g.shape != w.shape:
            return Verdict(float("nan"), float("nan"), False, f"shape {tuple(g.shape)} != {tuple(w.shape)}")
        if not torch.isfinite(g).all():
            return Verdict(float("inf"), float("inf"), False, "non-finite output (unwritten tile reads are NaN)")
        err = (g - w).abs().max().item() if g.numel() else 0.0
        scale = w.abs().max().item() if w.numel() else 0.0
        max_abs = max(max_abs, err)
        max_rel = max(max_rel, err / scale if scale > 0 else err)
        ok = ok and err <= atol + rtol * scale
    return Verdict(max_abs, max_rel, ok, run.note)


def randn(shape: Sequence[int], gen: torch.Generator, dtype: torch.dtype = torch.float32,
          scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen) * scale).to(dtype)


def gen_for(c: Case) -> torch.Generator:
    return torch.Generator().manual_seed(c.seed)
