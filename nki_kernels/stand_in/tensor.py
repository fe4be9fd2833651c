"""Tensors of the NumPy stand-in of `nki`: storage + strided view, memory space, and the write rules.

A `Tensor` is a NumPy view into a storage array (the "base"); slicing, `reshape` and `view(dtype)` return new
`Tensor`s over the same storage, so writes through any view land in the base. Every write
goes through `write()`, which casts fp32 engine results to the destination dtype with `ml_dtypes` rounding (RNE;
ints saturate) and keeps the PSUM matmul-accumulation flags right.
"""

from __future__ import annotations

import math

import numpy as np

PMAX = 128  # partitions
PSUM_PARTITION_BYTES = 16 * 1024  # 2 MiB / 128 partitions (8 banks x 2 KiB)
PSUM_BANK_FP32 = 512  # one bank per partition holds 512 fp32
SBUF_PARTITION_BYTES = 192 * 1024  # per-tile guard; trn2 has 224 KiB physical, less usable

HBM_BUFFERS = ("hbm", "private_hbm", "shared_hbm", "input_hbm")
ONCHIP_BUFFERS = ("sbuf", "psum")


class NkiRuleError(ValueError):
    """An operation the real NKI compiler/simulator/hardware rejects
    (each rule has a raising test in tests/kernels/test_stand_in_rules.py)."""


def _fresh_fill(dtype: np.dtype):
    # The official simulator fills fresh float memory with NaN and ints with 4.
    return np.nan if np.dtype(dtype).kind == "f" or _is_low_float(dtype) else 4


def _is_low_float(dtype) -> bool:
    dt = np.dtype(dtype)
    return dt.kind == "V" or dt.name in ("bfloat16", "float8_e4m3", "float8_e4m3fn", "float8_e5m2", "float8_e8m0fnu")


def is_float(dtype) -> bool:
    dt = np.dtype(dtype)
    return dt.kind == "f" or _is_low_float(dt)


def is_int(dtype) -> bool:
    return np.dtype(dtype).kind in ("i", "u", "b")


class Tensor:
    """A view of HBM / SBUF / PSUM storage. Dim 0 of an SBUF/PSUM tensor is the partition dim."""

    __slots__ = ("arr", "buffer", "name", "_mm", "sliced")

    def __init__(self, arr: np.ndarray, buffer: str, name: str = "", mm: np.ndarray | None = None,
                 sliced: bool = False):
        self.arr = arr
        self.buffer = buffer
        self.name = name
        self.sliced = sliced  # a slice of a tensor cannot be sliced again (NKI >= 0.2: no nested slicing)
        # PSUM only: per-element "last written by nc_matmul" flags (same view geometry as `arr`)
        self._mm = mm

    # ---- construction -------------------------------------------------------------------------
    @classmethod
    def alloc(cls, shape, dtype, buffer: str, name: str = "") -> Tensor:
        shape = tuple(int(s) for s in shape)
        dtype = np.dtype(dtype)
        if buffer not in HBM_BUFFERS + ONCHIP_BUFFERS:
            raise NkiRuleError(f"unknown buffer {buffer!r}")
        if any(s <= 0 for s in shape):
            raise NkiRuleError(f"tensor {name!r}: every dim must be positive, got {shape}")
        if buffer in ONCHIP_BUFFERS:
            check_partition(shape, f"{buffer} tensor {name!r}")
            free_bytes = math.prod(shape[1:]) * dtype.itemsize  # math.prod(()) == 1
            limit = PSUM_PARTITION_BYTES if buffer == "psum" else SBUF_PARTITION_BYTES
            if free_bytes > limit:
                raise NkiRuleError(f"{buffer} tensor {name!r} {shape} {dtype.name}: {free_bytes} B per partition "
                                   f"exceeds {limit} B")
        arr = np.empty(shape, dtype=dtype)
        arr[...] = _fresh_fill(dtype)
        mm = np.zeros(shape, dtype=bool) if buffer == "psum" else None
        return cls(arr, buffer, name, mm)

    # ---- properties ---------------------------------------------------------------------------
    @property
    def shape(self) -> tuple[int, ...]:
        return self.arr.shape  # already a tuple of ints

    @property
    def dtype(self) -> np.dtype:
        return self.arr.dtype

    @property
    def ndim(self) -> int:
        return self.arr.ndim

    @property
    def onchip(self) -> bool:
        return self.buffer in ONCHIP_BUFFERS

    @property
    def free_size(self) -> int:
        return math.prod(self.arr.shape[1:])  # Python ints: np.prod on a tiny tuple costs ~10x more

    def __repr__(self) -> str:
        return f"Tensor({self.name or '?'}, {self.shape}, {self.dtype.name}, {self.buffer})"

    # ---- views (share storage) ----------------------------------------------------------------
    def __getitem__(self, key) -> Tensor:
        if self.sliced:
            raise NkiRuleError(f"{self!r}: nested slicing is not available in NKI >= 0.2; slice the base tensor "
                               "once with the combined offsets")
        keys = key if isinstance(key, tuple) else (key,)
        for k in keys:
            if isinstance(k, slice):
                if k.step not in (None, 1):
                    raise NkiRuleError(f"{self!r}: only unit-step slices are supported, got {k}")
                for b in (k.start, k.stop):
                    if b is not None and not isinstance(b, (int, np.integer)):
                        raise NkiRuleError(f"{self!r}: slice bounds must be compile-time ints, got {b!r}")
            elif not isinstance(k, (int, np.integer)):
                raise NkiRuleError(f"{self!r}: index {k!r} is not an int or a slice (no arange/mask/fancy indexing)")
        if len(keys) > self.ndim:
            raise NkiRuleError(f"{self!r}: too many indices {key}")
        for d, k in enumerate(keys):
            n = self.arr.shape[d]
            if isinstance(k, slice):
                lo = 0 if k.start is None else int(k.start)
                hi = n if k.stop is None else int(k.stop)
                if not (0 <= lo < hi <= n):
                    raise NkiRuleError(f"{self!r}: slice {lo}:{hi} out of bounds or empty on dim {d} (size {n})")
            elif not 0 <= int(k) < n:
                raise NkiRuleError(f"{self!r}: index {k} out of bounds on dim {d} (size {n})")
        sub = self.arr[key]
        mm = self._mm[key] if self._mm is not None else None
        if self.onchip and isinstance(keys[0], (int, np.integer)):
            # dropping the partition dim of an on-chip tile would silently move data onto the free axis
            raise NkiRuleError(f"{self!r}: integer index on the partition dim; slice it (p:p+1) instead")
        return Tensor(sub, self.buffer, self.name, mm, sliced=True)

    def reshape(self, shape) -> Tensor:
        if self.sliced:
            raise NkiRuleError(f"{self!r}: reshape a whole tensor, not a slice of one")
        shape = tuple(int(s) for s in shape)
        v = self.arr.view()
        try:
            v.shape = shape  # raises instead of copying: a reshape must stay a view of the storage
        except (AttributeError, ValueError) as e:
            raise NkiRuleError(f"{self!r}: reshape to {shape} is not expressible as a view ({e})") from None
        mm = None
        if self._mm is not None:
            mm = self._mm.view()
            mm.shape = shape
        if self.onchip:
            check_partition(shape, f"reshaped {self!r}")
            if shape[0] != self.shape[0]:
                raise NkiRuleError(f"{self!r}: reshape must keep the partition dim ({self.shape[0]} -> {shape[0]})")
        return Tensor(v, self.buffer, self.name, mm)

    def view(self, dtype) -> Tensor:
        if self.sliced:
            raise NkiRuleError(f"{self!r}: reinterpret a whole tensor, not a slice of one")
        dtype = np.dtype(dtype)
        if dtype.itemsize != self.dtype.itemsize:
            raise NkiRuleError(f"{self!r}: view({dtype.name}) must keep the element size")
        if self._mm is not None:
            raise NkiRuleError(f"{self!r}: bit views of PSUM are not supported by the stand-in")
        return Tensor(self.arr.view(dtype), self.buffer, self.name, None)

    # ---- reading / writing --------------------------------------------------------------------
    def read_f32(self) -> np.ndarray:
        """Value as the engines see it: widened to fp32 (exact for bf16/fp8/fp16; ints converted)."""
        return self.arr.astype(np.float32)

    def write(self, value: np.ndarray, *, from_matmul: bool = False) -> None:
        """Store `value` (fp32 or integer engine result) into this view, rounding to the storage dtype."""
        value = np.asarray(value)
        if value.shape != self.arr.shape:
            value = value.reshape(self.arr.shape)
        self.arr[...] = cast(value, self.dtype)
        if self._mm is not None:
            self._mm[...] = from_matmul

    def numpy(self) -> np.ndarray:
        return np.array(self.arr, copy=True)


def cast(value: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """Engine result -> storage dtype: floats round to nearest even through ml_dtypes; ints round and saturate."""
    dtype = np.dtype(dtype)
    value = np.asarray(value)
    if is_int(dtype):
        if is_int(value.dtype):
            info = np.iinfo(dtype)
            return np.clip(value.astype(np.int64), info.min, info.max).astype(dtype)
        info = np.iinfo(dtype)
        v = np.rint(value.astype(np.float64))
        v = np.nan_to_num(v, nan=0.0, posinf=info.max, neginf=info.min)
        return np.clip(v, info.min, info.max).astype(dtype)
    if value.dtype == dtype:
        return value
    if is_int(value.dtype):
        value = value.astype(np.float32)
    return value.astype(np.float32).astype(dtype)


def check_partition(shape, what: str) -> None:
    if len(shape) == 0:
        raise NkiRuleError(f"{what}: on-chip tensors need a partition dim")
    if shape[0] > PMAX:
        raise NkiRuleError(f"{what}: partition dim {shape[0]} exceeds {PMAX}")
