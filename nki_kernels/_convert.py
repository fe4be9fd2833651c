"""torch <-> NumPy conversion at the wrapper boundary (bit-exact for bf16 / fp8 via ml_dtypes)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import torch

_TORCH_TO_NP = {
    torch.float32: np.dtype(np.float32),
    torch.bfloat16: np.dtype(ml_dtypes.bfloat16),
    torch.float16: np.dtype(np.float16),
    torch.int32: np.dtype(np.int32),
    torch.int64: np.dtype(np.int64),
    torch.uint8: np.dtype(np.uint8),
    torch.int8: np.dtype(np.int8),
}
_BITS = {torch.bfloat16: torch.int16, torch.float8_e4m3fn: torch.uint8, torch.float8_e5m2: torch.uint8}


def to_np(t: torch.Tensor, *, copy: bool = True) -> np.ndarray:
    """Contiguous CPU NumPy array with the same bits (bf16 -> ml_dtypes.bfloat16): a copy, or with `copy=False` a
    read-only array that shares the memory of a contiguous CPU tensor (no copy; else of its contiguous CPU copy)."""
    t = t.detach().contiguous().cpu()
    if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise TypeError("pass fp8 weights as trn2 e4m3 codes (uint8) via blockquant.to_trn2_fp8, not torch fp8")
    a = t.view(torch.int16).numpy().view(ml_dtypes.bfloat16) if t.dtype == torch.bfloat16 else t.numpy()
    if copy:
        return a.copy()
    a = a.view()  # a new array object: the read-only flag never touches an array someone else holds
    a.flags.writeable = False
    return a


def from_np(a: np.ndarray) -> torch.Tensor:
    a = np.ascontiguousarray(a)
    if a.dtype == np.dtype(ml_dtypes.bfloat16):
        return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
    if a.dtype in (np.dtype(ml_dtypes.float8_e4m3), np.dtype(ml_dtypes.float8_e5m2)):
        return torch.from_numpy(a.astype(np.float32))
    return torch.from_numpy(a.copy())


def np_dtype(t: torch.dtype) -> np.dtype:
    return _TORCH_TO_NP[t]


def dtype_name(t: torch.dtype) -> str:
    return str(t).replace("torch.", "")
