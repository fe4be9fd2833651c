"""The ten kernel families, by name -> module (imported lazily so `import nki_kernels` stays light)."""

from __future__ import annotations

import importlib
from types import ModuleType

KERNELS: dict[str, str] = {
    "rmsnorm": "nki_kernels.rmsnorm",
    "swiglu": "nki_kernels.swiglu",
    "hc_collapse": "nki_kernels.hc_collapse",
    "hc_expand": "nki_kernels.hc_expand",
    "hc_mixes": "nki_kernels.hc_mixes",
    "hc_attn_out": "nki_kernels.hc_attn_out",
    "compress_pool": "nki_kernels.compress_pool",
    "index_score": "nki_kernels.index_score",
    "sparse_attn": "nki_kernels.sparse_attn",
    "blockquant": "nki_kernels.blockquant",
}


def load(name: str) -> ModuleType:
    if name not in KERNELS:
        raise KeyError(f"unknown kernel {name!r}; known: {', '.join(KERNELS)}")
    return importlib.import_module(KERNELS[name])


def kernel_files() -> list[str]:
    """Source files of every kernel module plus the shared sub-kernels (the static check's input)."""
    files = [importlib.util.find_spec(mod).origin for mod in KERNELS.values()]
    files.append(importlib.util.find_spec("nki_kernels._tiles").origin)
    return files
