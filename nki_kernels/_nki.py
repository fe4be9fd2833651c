"""The one place that imports `nki`: the real one (AWS Neuron repository, NKI >= 0.3) or the NumPy stand-in.

Kernel modules do `from nki_kernels._nki import nki, nl, nisa` and decorate with `@nki.jit`. Here `nki.jit` returns
a `Kernel` handle that keeps the plain function; at call time the handle binds `nki`/`nl`/`nisa` in a copy of the
kernel module's globals to the chosen backend (the real modules for the compiler/simulator/device, the stand-in
modules for a CPU run) and runs it. So the same source compiles with the real `nki` and runs on the stand-in, even
on a machine that has both (the trn2 check diffs them).

Nothing here is imported by `import nki_kernels`; the real `nki` is probed lazily (and the PyPI placeholder,
which has no `jit`, is treated as absent). This module never reads the environment: the caller decides the
executor (see `nki_kernels.dispatch`).
"""

from __future__ import annotations

import functools
import glob
import importlib
import types
from typing import Any

# ---- NKI 0.7 / 0.8 (Neuron SDK 2.33 / 2.34, the SDKs of TorchNeuron): what changed for these kernels ---------------
# Read (2026-12-04, through the docs search; the SDK repository snapshot here stops at 2.32 / NKI 0.6):
#   SDK v2.33.1 `nki/migration/index.html` "Migrating from NKI 0.6.0 to NKI 0.7.0" (its introduction),
#   `release-notes/components/nki` "NKI [0.7.0] (Neuron 2.33.0 Release)" (its introduction), the announcements
#   `announce-nki-specialization-change` (2026-10-16), `announce-intent-eos-nki-virtualregister-lnc-apis` (NKI 0.8.0
#   deprecations), `announce-removal-neuronxcc-nki-2-34`, `announce-intent-eos-nki-spmd-launch-grid`, and the
#   error code page `compiler/error-codes/EVRF066`. NOT found in the stored material: the body of "Migrating from
#   NKI 0.7.0 to NKI 0.8.0" and of the NKI 0.8.0 release notes (only the deprecation announcement that links them),
#   nor the 0.7 / 0.8 API reference: the signatures in static_check.py remain the 0.6 ones.
# What the notes change, checked against every construct of the kernel files (grep of nki_kernels/*.py):
# * 0.7: specialization traces the kernel with Python (NKI API calls emit the IR) instead of compiler passes over
#   the source. The kernels here use only Python `range` loops, `if` on Python ints and calls of plain helper
#   functions (_tiles.py): unrolled / resolved at trace time as before; `_rebind` hands the tracer a copy of the
#   function whose globals are the real `nki` modules, which is what a Python tracer calls. No change needed.
# * 0.7: `nl.dynamic_range` and `while <register>:` loops removed (fori_loop / while_loop): not used here.
# * 0.7: `==` on user-defined classes follows Python semantics: the kernels compare ints only.
# * 0.7: the compiler rejects a kernel whose LNC differs from neuronx-cc's (NCC_EVRF066; a bare `kernel(...)` is
#   LNC 1, neuronx-cc defaults to 2 on trn2). `Kernel.run` launches `kernel[lnc]` with lnc = NEURON_LOGICAL_NC_CONFIG
#   (engine.stack.logical_nc_config), the same variable TorchNeuron's worker environment sets for neuronx-cc
#   (engine/backends/torchneuron.py `worker_env`); the bare call only for lnc 1. A NEURON_CC_FLAGS="--lnc=N" that
#   disagrees now fails at compile time (EVRF066) instead of at run time. The `[lnc]` launch grid is announced as
#   deprecated (a matching grid keeps working; a mismatching one is a compile error).
# * 0.7: `NKI_COMPILER_FRONTEND=custom` keeps the old specialization (deprecated, removed in 2.34): not needed.
# * 0.8 deprecations (DeprecationWarning, removal later): nisa.sendrecv / sendrecv_compute / core_barrier (-> nki.lnc),
#   nisa.register_* / VirtualRegister (-> scalar_load / scalar_store, NkiScalar): not used here.
# * 0.8 announced: nisa.tensor_tensor / tensor_scalar with a bitvec operator will reject engine=gpsimd / scalar.
#   blockquant's FP4 decode uses bitwise_and / bitwise_or / left_shift / right_shift in tensor_scalar and
#   tensor_tensor without an `engine` argument, which is the form the notes ask for. local_gather: not used.
# * 2.34: `neuronxcc.nki` removed from neuronx-cc: this project imports only the standalone `nki`.
# So the kernels need no source change for 0.7 / 0.8 by these notes; engine/stack.py accepts 0.6, 0.7 and 0.8. Not
# verified: any compile with the real NKI 0.7 / 0.8 (nothing of the SDK installs here).


@functools.cache
def real_nki() -> tuple[Any, Any, Any] | None:
    """(nki, nki.language, nki.isa) of the real NKI, or None when absent or the PyPI placeholder."""
    try:
        mod = importlib.import_module("nki")
    except Exception:  # the placeholder raises ImportError; anything else also means "not usable"
        return None
    if not hasattr(mod, "jit"):
        return None
    try:
        return mod, importlib.import_module("nki.language"), importlib.import_module("nki.isa")
    except Exception:
        return None


@functools.cache
def stand_in() -> tuple[Any, Any, Any]:
    from nki_kernels import stand_in as si

    return si, si.language, si.isa


def has_neuron_device() -> bool:
    """A Neuron device node exists (the probe vllm-neuron uses)."""
    return bool(glob.glob("/dev/neuron*"))


def backend(kind: str) -> tuple[Any, Any, Any]:
    if kind == "stand-in":
        return stand_in()
    if kind == "real":
        r = real_nki()
        if r is None:
            raise RuntimeError("the real `nki` (NKI >= 0.3 from the AWS Neuron repository) is not installed")
        return r
    raise ValueError(f"unknown nki backend {kind!r}")


class _Lazy:
    """Module-level default for `nl` / `nisa` in kernel modules: the real one if installed, else the stand-in.

    `Kernel` rebinds these names before running, so kernels never see the proxy at run time; it only serves
    module-level attribute access (e.g. dtypes in wrappers)."""

    def __init__(self, index: int):
        self._index = index

    def __getattr__(self, name: str) -> Any:
        mods = real_nki() or stand_in()
        return getattr(mods[self._index], name)


# Modules whose plain functions are sub-kernels (inlined by the NKI compiler), rebound along with the kernel.
SUBKERNEL_MODULES = ("nki_kernels._tiles",)


def _rebind(fn: types.FunctionType, mods: tuple[Any, Any, Any], memo: dict[str, dict]) -> types.FunctionType:
    """Copy `fn` with `nki`/`nl`/`nisa` bound to `mods` in its module globals, recursively for sub-kernels."""
    mod_name = fn.__module__
    g = memo.get(mod_name)
    if g is None:
        src_globals = fn.__globals__
        g = dict(src_globals)
        memo[mod_name] = g
        g.update(nki=mods[0], nl=mods[1], nisa=mods[2])
        for name, obj in src_globals.items():
            f = obj.fn if isinstance(obj, Kernel) else obj
            if not isinstance(f, types.FunctionType):
                continue
            if f.__module__ == mod_name:
                g[name] = types.FunctionType(f.__code__, g, f.__name__, f.__defaults__, f.__closure__)
            elif f.__module__ in SUBKERNEL_MODULES:
                g[name] = _rebind(f, mods, memo)
    f = g.get(fn.__name__)
    if isinstance(f, types.FunctionType) and f.__code__ is fn.__code__:
        return f
    return types.FunctionType(fn.__code__, g, fn.__name__, fn.__defaults__, fn.__closure__)


class Kernel:
    """What `@nki.jit` returns here: the plain kernel function plus per-backend bound copies."""

    def __init__(self, fn: types.FunctionType):
        self.fn = fn
        self.__name__ = fn.__name__
        self.__doc__ = fn.__doc__
        self._bound: dict[str, types.FunctionType] = {}
        self._jitted: dict[int, Any] = {}  # lnc -> real nki.jit object (kept: NKI caches compiles per object)
        self._plain: Any = None  # the real nki.jit object without a launch grid (`jitted()`)

    def bind(self, kind: str) -> types.FunctionType:
        """A copy of the kernel whose globals (and those of its helper sub-kernels) use backend `kind`."""
        if kind not in self._bound:
            self._bound[kind] = _rebind(self.fn, backend(kind), {})
        return self._bound[kind]

    def run(self, executor: str, *args, lnc: int = 2):
        """Run on `executor` ('stand-in' | 'simulator' | 'neuron') with NumPy array / compile-time arguments, or
        on 'neuron' also with torch tensors: the real `nki.jit` callable picks its integration from the argument
        types (torch.Tensor: the PyTorch integration, the kernel inside the framework's graph on the device, torch
        results; np.ndarray: a standalone run, NumPy results). Arguments are passed through unchanged.

        `lnc` > 1 launches `kernel[lnc]` on the real NKI (it must equal NEURON_LOGICAL_NC_CONFIG); the kernels do
        not split work by `nl.program_id`, so each core computes the whole (identical) result."""
        if executor == "stand-in":
            si = stand_in()[0]
            return si.run(self.bind("stand-in"), *args)
        real, _, _ = backend("real")
        if lnc not in self._jitted:
            jitted = real.jit(self.bind("real"))
            self._jitted[lnc] = jitted[lnc] if lnc > 1 else jitted
        jitted = self._jitted[lnc]
        if executor == "simulator":
            return real.simulate(jitted)(*args)
        if executor == "neuron":
            return jitted(*args)
        raise ValueError(f"unknown executor {executor!r}")

    def jitted(self) -> Any:
        """The real `nki.jit` object of this kernel without a launch grid: what TorchNeuron's `wrap_nki(...)[lnc]`
        takes (nki_kernels/torch_ops.py; the LNC subscript is wrap_nki's). Kept, as NKI caches compiles per object."""
        if self._plain is None:
            real, _, _ = backend("real")
            self._plain = real.jit(self.bind("real"))
        return self._plain

    def __call__(self, *args):
        raise TypeError(f"call {self.__name__} through its wrapper (or Kernel.run(executor, ...)), not directly")


def _jit(fn=None, **kwargs):
    if kwargs:
        raise TypeError(f"nki.jit options {sorted(kwargs)} are not used by this project (platform via env only)")
    if fn is None:
        return _jit
    return Kernel(fn)


nki = types.SimpleNamespace(jit=_jit)
nl: Any = _Lazy(1)
nisa: Any = _Lazy(2)
