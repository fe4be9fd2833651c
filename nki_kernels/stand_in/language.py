"""Stand-in for `nki.language`: dtypes, memory spaces, tile-size constants, allocation and the op identifiers.

Only what the project's kernels use. The math ops (`nl.exp`, `nl.add`, ...) are identifiers passed to `nki.isa`
instructions here; calling them as tile functions is not part of the subset and raises `NotImplementedError`.
Any other attribute raises `NotImplementedError` too, so a kernel that strays outside the subset fails loudly.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import ml_dtypes
import numpy as np

from nki_kernels.stand_in.tensor import NkiRuleError, Tensor

# ---- dtypes (trn2: float8_e4m3 is the legacy IEEE-like e4m3 with max 240; e4m3fn exists but is gen4-only) ----
bool_ = np.dtype(np.bool_)
int8 = np.dtype(np.int8)
int16 = np.dtype(np.int16)
int32 = np.dtype(np.int32)
uint8 = np.dtype(np.uint8)
uint16 = np.dtype(np.uint16)
uint32 = np.dtype(np.uint32)
float16 = np.dtype(np.float16)
float32 = np.dtype(np.float32)
bfloat16 = np.dtype(ml_dtypes.bfloat16)
float8_e4m3 = np.dtype(ml_dtypes.float8_e4m3)
float8_e5m2 = np.dtype(ml_dtypes.float8_e5m2)
float8_e4m3fn = np.dtype(ml_dtypes.float8_e4m3fn)

# ---- memory spaces ------------------------------------------------------------------------------
sbuf = "sbuf"
psum = "psum"
hbm = "hbm"
private_hbm = "private_hbm"
shared_hbm = "shared_hbm"

tile_size = SimpleNamespace(pmax=128, gemm_stationary_fmax=128, gemm_moving_fmax=512, psum_fmax=512,
                            psum_bank_fmax=512)


def ndarray(shape, dtype, buffer=sbuf, name="", address=None):
    """Allocate a tensor. Fresh memory is garbage: floats NaN, ints 4 (like the official simulator)."""
    if address is not None:
        raise NotImplementedError("manual placement (address=) is not modelled by the stand-in")
    if not isinstance(shape, tuple):
        raise NkiRuleError(f"nl.ndarray shape must be a tuple, got {type(shape).__name__}")
    return Tensor.alloc(shape, dtype, buffer, name)


def zeros(shape, dtype, buffer=sbuf, name=""):
    t = ndarray(shape, dtype, buffer=buffer, name=name)
    t.write(np.zeros(t.shape, np.float32))
    return t


# ---- op identifiers -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Op:
    name: str
    kind: str  # "binary" | "unary" | "bitwise" | "compare"

    def __call__(self, *args, **kwargs):
        raise NotImplementedError(f"nl.{self.name}(...) as a tile function is outside the stand-in subset; "
                                  "use the nki.isa instruction that takes it as `op`")

    def __repr__(self) -> str:
        return f"nl.{self.name}"


add = Op("add", "binary")
subtract = Op("subtract", "binary")
multiply = Op("multiply", "binary")
maximum = Op("maximum", "binary")
minimum = Op("minimum", "binary")
divide = Op("divide", "binary")
power = Op("power", "binary")
bitwise_and = Op("bitwise_and", "bitwise")
bitwise_or = Op("bitwise_or", "bitwise")
left_shift = Op("left_shift", "bitwise")
right_shift = Op("right_shift", "bitwise")
greater = Op("greater", "compare")
greater_equal = Op("greater_equal", "compare")
less = Op("less", "compare")
less_equal = Op("less_equal", "compare")
equal = Op("equal", "compare")
not_equal = Op("not_equal", "compare")
exp = Op("exp", "unary")
log = Op("log", "unary")
sqrt = Op("sqrt", "unary")
rsqrt = Op("rsqrt", "unary")
reciprocal = Op("reciprocal", "unary")
sigmoid = Op("sigmoid", "unary")
silu = Op("silu", "unary")
relu = Op("relu", "unary")
tanh = Op("tanh", "unary")
square = Op("square", "unary")
copy = Op("copy", "unary")
abs = Op("abs", "unary")  # noqa: A001 - mirrors nl.abs
negative = Op("negative", "unary")


def _sigmoid(x):
    with np.errstate(over="ignore"):
        return 1.0 / (1.0 + np.exp(-x))


UNARY = {
    "exp": np.exp, "log": np.log, "sqrt": np.sqrt, "rsqrt": lambda x: 1.0 / np.sqrt(x),
    "reciprocal": lambda x: 1.0 / x, "sigmoid": _sigmoid, "silu": lambda x: x * _sigmoid(x),
    "relu": lambda x: np.maximum(x, 0.0), "tanh": np.tanh, "square": np.square, "copy": lambda x: x,
    "abs": np.abs, "negative": np.negative,
}
BINARY = {
    "add": np.add, "subtract": np.subtract, "multiply": np.multiply, "maximum": np.maximum, "minimum": np.minimum,
    "divide": np.divide, "power": np.power,
}
BITWISE = {
    "bitwise_and": np.bitwise_and, "bitwise_or": np.bitwise_or, "left_shift": np.left_shift,
    "right_shift": np.right_shift,
}
COMPARE = {
    "greater": np.greater, "greater_equal": np.greater_equal, "less": np.less, "less_equal": np.less_equal,
    "equal": np.equal, "not_equal": np.not_equal,
}


def __getattr__(name: str):
    raise NotImplementedError(f"nki.language.{name} is not implemented by the NumPy stand-in (outside the subset)")
