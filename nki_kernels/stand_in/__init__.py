"""A strict NumPy stand-in of the `nki` subset this project's kernels use.

Used only when the real `nki` (from the AWS Neuron pip repository) is absent, or when a caller asks for it by
name (the trn2 check diffs stand-in vs simulator vs device). It proves kernel *logic* and the documented tile
rules; it does not prove compilability, scheduling, SBUF/PSUM capacity or performance.

`run(fn, *args)` executes a kernel function eagerly: NumPy array arguments become HBM tensors, everything else
(ints, floats, tuples, dtypes) is passed through as a compile-time value; every returned tensor must have been
allocated in `nl.shared_hbm`.
"""

from __future__ import annotations

import numpy as np

from nki_kernels.stand_in import isa, language
from nki_kernels.stand_in.tensor import NkiRuleError, Tensor

__all__ = ["NkiRuleError", "Tensor", "isa", "jit", "language", "run"]


def _wrap(arg):
    if isinstance(arg, np.ndarray):
        return Tensor(np.ascontiguousarray(arg), "input_hbm", "input")
    if isinstance(arg, list):
        raise NkiRuleError("kernel list arguments must be tuples (NKI >= 0.3)")
    return arg


def run(fn, *args, **kwargs):
    """Run kernel function `fn` on the stand-in; returns NumPy array(s) copied out of the shared_hbm outputs."""
    out = fn(*(_wrap(a) for a in args), **{k: _wrap(v) for k, v in kwargs.items()})
    outs = out if isinstance(out, tuple) else (out,)
    for o in outs:
        if not isinstance(o, Tensor):
            raise NkiRuleError(f"kernel {fn.__name__} returned {type(o).__name__}, not a tensor")
        if o.buffer != "shared_hbm":
            raise NkiRuleError(f"kernel {fn.__name__}: output {o!r} must be allocated with buffer=nl.shared_hbm")
    res = tuple(o.numpy() for o in outs)
    return res if isinstance(out, tuple) else res[0]


def jit(fn=None, **kwargs):
    """`nki.jit` stand-in: calling the result runs the kernel eagerly on NumPy arrays."""
    if kwargs.get("platform_target") is not None:
        raise NkiRuleError("jit(platform_target=...) raises since NKI 0.3; use NEURON_PLATFORM_TARGET_OVERRIDE")

    def deco(f):
        def call(*args, **kw):
            return run(f, *args, **kw)

        call.func = f
        call.__name__ = f.__name__
        return call

    return deco(fn) if fn is not None else deco
