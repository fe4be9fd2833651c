"""Executor choice and dispatch counting for the kernel wrappers.

Order for `executor="auto"`: a real Neuron device with the real `nki` -> the kernel on the device; the real `nki`
with the simulator requested -> `nki.simulate`; otherwise -> the NumPy stand-in. The torch reference runs only when
asked for by name (`executor="reference"`). Every call is counted per (kernel, executor), so a test can prove which
path ran and a fallback can never pass as kernel coverage.

This module reads no environment variables: the CLI passes `simulator=True` when `NKI_SIMULATOR=1` was recorded
by `engine.envs` (nki_kernels never imports engine).
"""

from __future__ import annotations

import contextlib
import enum
from collections import Counter
from collections.abc import Callable
from typing import Any

from nki_kernels import _nki


class Executor(str, enum.Enum):
    """Where a kernel call runs (the one list of executors; `deepinfer kernels --executor` and the engine use it)."""

    AUTO = "auto"
    STAND_IN = "stand-in"
    SIMULATOR = "simulator"
    NEURON = "neuron"
    REFERENCE = "reference"

    def __str__(self) -> str:
        return self.value


EXECUTORS = tuple(e.value for e in Executor)
# what a user may pick for a whole kernel run (the reference is the comparison, not an executor of the kernels)
KERNEL_EXECUTORS = tuple(e for e in EXECUTORS if e != "reference")

COUNTS: Counter[tuple[str, str]] = Counter()
# (name, reason) of every explicit fallback to the reference (see `fallback`); COUNTS has them as
# ("<name>.fallback", "reference"), so a fallback never shows up under the kernel's own name.
FALLBACKS: Counter[tuple[str, str]] = Counter()
# When a list is installed here (see `record`), every kernel dispatch appends (name, kernel, args): the trn2
# check replays the exact operands on the simulator and the device.
_RECORDER: list | None = None

PROVES = {
    "stand-in": "kernel logic verified on the NumPy stand-in (not compiled)",
    "simulator": "kernel compiled by the real NKI front end and run on the official CPU simulator (nki.simulate)",
    "neuron": "kernel compiled with the real NKI and run on a Neuron device",
    "reference": "torch reference only (no kernel ran)",
}


def resolve_executor(requested: str = "auto", *, simulator: bool = False) -> str:
    """The concrete executor for `requested`; raises when an explicit one is unavailable here."""
    requested = str(requested)
    if requested not in EXECUTORS:
        raise ValueError(f"unknown executor {requested!r}; expected one of {', '.join(EXECUTORS)}")
    have_real = _nki.real_nki() is not None
    if requested == "auto":
        if have_real and _nki.has_neuron_device():
            return "neuron"
        if have_real and simulator:
            return "simulator"
        return "stand-in"
    if requested in ("simulator", "neuron") and not have_real:
        raise RuntimeError(f"executor {requested!r} needs the real `nki` (AWS Neuron repository), which is absent")
    if requested == "neuron" and not _nki.has_neuron_device():
        raise RuntimeError("executor 'neuron' needs a Neuron device (/dev/neuron*)")
    return requested


_default: dict[str, Any] = {"executor": "auto", "simulator": False, "lnc": 2}


def set_default(executor: str = "auto", *, simulator: bool = False, lnc: int | None = None) -> None:
    """Process defaults used by wrappers called with executor=None, and the logical NeuronCore config every kernel
    launch uses (`kernel[lnc]` on the real NKI; set once by the CLI/engine from engine.stack.logical_nc_config(),
    i.e. NEURON_LOGICAL_NC_CONFIG, trn2's default 2). This module reads no environment itself."""
    if executor not in EXECUTORS:
        raise ValueError(f"unknown executor {executor!r}")
    if lnc is not None and lnc not in (1, 2):
        raise ValueError(f"lnc must be 1 or 2, got {lnc!r}")
    _default.update(executor=executor, simulator=simulator, **({"lnc": lnc} if lnc is not None else {}))


def default_lnc() -> int:
    return int(_default["lnc"])


def resolve(executor: str | None) -> str:
    """The executor a `dispatch(..., executor)` call runs on (None: the process default of `set_default`)."""
    return resolve_executor(executor or _default["executor"], simulator=_default["simulator"])


def dispatch(name: str, kernel: _nki.Kernel, args: tuple, executor: str | None,
             reference: Callable[[], Any] | None = None) -> tuple[str, Any]:
    """Run kernel `name` on the resolved executor; returns (executor, raw result). Counts the call. `args` go to
    `Kernel.run` as given: NumPy arrays for the host executors (and a standalone run on "neuron"), torch tensors
    for the PyTorch integration of `nki.jit` on "neuron" (see `kernel_ops.KernelOps._run`)."""
    ex = resolve(executor)
    COUNTS[(name, ex)] += 1
    if _RECORDER is not None and ex != "reference":
        _RECORDER.append((name, kernel, args))
    if ex == "reference":
        if reference is None:
            raise ValueError(f"{name}: no reference path")
        return ex, reference()
    return ex, kernel.run(ex, *args, lnc=_default["lnc"])


def fallback(name: str, reason: str, reference: Callable[[], Any]) -> Any:
    """Run the torch reference instead of kernel `name` for a case the kernel does not cover; counted as
    ("<name>.fallback", "reference") in COUNTS and by reason in FALLBACKS, never as kernel coverage."""
    COUNTS[(f"{name}.fallback", "reference")] += 1
    FALLBACKS[(name, reason)] += 1
    return reference()


@contextlib.contextmanager
def record():
    """Collect (name, kernel, args) of every kernel dispatch inside the block."""
    global _RECORDER
    calls: list = []
    prev, _RECORDER = _RECORDER, calls
    try:
        yield calls
    finally:
        _RECORDER = prev


def counts(name: str | None = None) -> dict[tuple[str, str], int]:
    return {k: v for k, v in COUNTS.items() if name is None or k[0] == name}


def fallbacks(name: str | None = None) -> dict[tuple[str, str], int]:
    return {k: v for k, v in FALLBACKS.items() if name is None or k[0] == name}


def reset_counts() -> None:
    COUNTS.clear()
    FALLBACKS.clear()
