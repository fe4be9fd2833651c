"""Executor choice and dispatch counting for the kernel wrappers.

Order for `executor="auto"`: a real Neuron device with the real `nki` -> the kernel on the device; the real `nki`
with the simulator requested -> `nki.simulate`; otherwise -> the NumPy stand-in. The torch reference runs only when
asked for by name (`executor="reference"`). Every call is counted per (kernel, executor), so a test can prove which
path ran and a fallback can never pass as kernel coverage.

The state of the launches (executor default, LNC, counters, recorder) is a `Dispatcher` owned by whoever runs
kernels - an engine's runner, a `deepinfer kernels` run - and activated around its work; nothing here is set from
outside. This module reads no environment variables: the owner passes `simulator=True` when `NKI_SIMULATOR=1` was
recorded by `engine.envs`, and the LNC (nki_kernels never imports engine).
"""

from __future__ import annotations

import contextlib
import contextvars
import enum
from collections import Counter
from collections.abc import Callable, Iterator
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


class Dispatcher:
    """The state of kernel launches, owned by whoever runs kernels: the executor default, the NeuronCore LNC every
    launch uses (`kernel[lnc]` on the real NKI: NEURON_LOGICAL_NC_CONFIG, trn2's default 2, passed in by the
    owner - this module reads no environment), the counters and an optional recorder. The engine makes one per
    runner (engine/launch.py) and activates it around each forward; `deepinfer kernels` makes its own for a run.
    Module-level `dispatch(...)` / `fallback(...)` / `count(...)` go to the active one (`current()`), else to a
    process-wide default for standalone kernel calls (tests, notebooks).

    `counts` has every call per (kernel, executor); `fallbacks` every explicit fallback to the reference per
    (name, reason) (also counted as ("<name>.fallback", "reference") in `counts`, so a fallback never shows up under
    the kernel's own name). With a list installed by `record()`, every kernel dispatch appends (name, kernel, args):
    the trn2 check replays the exact operands on the simulator and the device."""

    def __init__(self, executor: str = "auto", *, simulator: bool = False, lnc: int = 2) -> None:
        if str(executor) not in EXECUTORS:
            raise ValueError(f"unknown executor {executor!r}")
        if lnc not in (1, 2):
            raise ValueError(f"lnc must be 1 or 2, got {lnc!r}")
        self.executor, self.simulator, self.lnc = str(executor), simulator, lnc
        self.counts: Counter[tuple[str, str]] = Counter()
        self.fallbacks: Counter[tuple[str, str]] = Counter()
        self._recorder: list | None = None

    def resolve(self, executor: str | None = None) -> str:
        """The executor a call runs on (None: this dispatcher's default)."""
        return resolve_executor(executor or self.executor, simulator=self.simulator)

    def dispatch(self, name: str, kernel: _nki.Kernel, args: tuple, executor: str | None = None,
                 reference: Callable[[], Any] | None = None) -> tuple[str, Any]:
        """Run kernel `name` on the resolved executor; returns (executor, raw result). Counts the call. `args` go
        to `Kernel.run` as given: NumPy arrays for the host executors (and a standalone run on "neuron"), torch
        tensors for the PyTorch integration of `nki.jit` on "neuron" (see `kernel_ops.KernelOps._run`)."""
        ex = self.resolve(executor)
        self.counts[(name, ex)] += 1
        if self._recorder is not None and ex != "reference":
            self._recorder.append((name, kernel, args))
        if ex == "reference":
            if reference is None:
                raise ValueError(f"{name}: no reference path")
            return ex, reference()
        return ex, kernel.run(ex, *args, lnc=self.lnc)

    def fallback(self, name: str, reason: str, reference: Callable[[], Any]) -> Any:
        """Run the torch reference instead of kernel `name` for a case the kernel does not cover; counted as
        ("<name>.fallback", "reference") and by reason, never as kernel coverage."""
        self.counts[(f"{name}.fallback", "reference")] += 1
        self.fallbacks[(name, reason)] += 1
        return reference()

    def count(self, name: str, executor: str) -> None:
        """Count a call that ran outside `dispatch` (the native host kernels)."""
        self.counts[(name, executor)] += 1

    def count_each(self, keys: tuple[tuple[str, str], ...], times: int = 1) -> None:
        """`count` every (name, executor) of `keys` `times` times (a native call that runs several kernels)."""
        counts = self.counts
        for key in keys:
            counts[key] += times

    def counts_of(self, name: str | None = None) -> dict[tuple[str, str], int]:
        return {k: v for k, v in self.counts.items() if name is None or k[0] == name}

    def fallbacks_of(self, name: str | None = None) -> dict[tuple[str, str], int]:
        return {k: v for k, v in self.fallbacks.items() if name is None or k[0] == name}

    def reset(self) -> None:
        self.counts.clear()
        self.fallbacks.clear()

    @contextlib.contextmanager
    def record(self) -> Iterator[list]:
        """Collect (name, kernel, args) of every kernel dispatch inside the block."""
        calls: list = []
        prev, self._recorder = self._recorder, calls
        try:
            yield calls
        finally:
            self._recorder = prev

    @contextlib.contextmanager
    def active(self) -> Iterator[Dispatcher]:
        """Make this the dispatcher of the module-level calls inside the block (this thread / task)."""
        token = _ACTIVE.set(self)
        try:
            yield self
        finally:
            _ACTIVE.reset(token)


_PROCESS_DEFAULT = Dispatcher()  # standalone kernel calls outside any owner's `active()` block
_ACTIVE: contextvars.ContextVar[Dispatcher | None] = contextvars.ContextVar("deepinfer_dispatcher", default=None)


def current() -> Dispatcher:
    """The active dispatcher (an engine's during its forward, a kernel run's), else the process default."""
    return _ACTIVE.get() or _PROCESS_DEFAULT


def dispatch(name: str, kernel: _nki.Kernel, args: tuple, executor: str | None,
             reference: Callable[[], Any] | None = None) -> tuple[str, Any]:
    """`current().dispatch(...)`: what every kernel wrapper calls."""
    return current().dispatch(name, kernel, args, executor, reference)


# fallbacks traced into a compiled graph, per (name, reason): counted per execution of the graph (Dynamo replays a
# global counter's update after each run), here because the active dispatcher (a context variable) is not readable
# inside a trace
IN_GRAPH_FALLBACKS: Counter[tuple[str, str]] = Counter()


def fallback(name: str, reason: str, reference: Callable[[], Any]) -> Any:
    """`current().fallback(...)`; inside a traced graph the reference is traced into the graph and the fallback is
    counted in `IN_GRAPH_FALLBACKS` (never silently)."""
    import torch

    if torch.compiler.is_compiling():
        IN_GRAPH_FALLBACKS[(name, reason)] += 1
        return reference()
    return current().fallback(name, reason, reference)


def count(name: str, executor: str) -> None:
    current().count(name, executor)


def resolve(executor: str | None) -> str:
    """The executor a `dispatch(..., executor)` call runs on (None: the current dispatcher's default)."""
    return current().resolve(executor)


def counts(name: str | None = None) -> dict[tuple[str, str], int]:
    return current().counts_of(name)


def fallbacks(name: str | None = None) -> dict[tuple[str, str], int]:
    return current().fallbacks_of(name)


def reset_counts() -> None:
    current().reset()


def record() -> contextlib.AbstractContextManager[list]:
    return current().record()
