"""Native host kernels of `--kernels host`: C kernels (gemv.c, mhc.c, moe.c, attn.c) built for the best instruction
set this CPU runs and loaded with ctypes (build.py), wrapped as ops with the reference's signatures (table.py).
Memory-bound decode on a CPU is why: they read stored FP8 / FP4 / bf16 weights once and run a step's small ops and
whole layers without the Python between torch ops. native: library handle, row limits; gemm, small_ops, moe_ops,
attn_ops, step_ops: the ops; packs, abi, layer_ops: the one-call layer; block_decoder: the model's adapter."""

from __future__ import annotations

import sys
import types

from engine.host_kernels import attn_ops, layer_ops, native, step_ops
from engine.host_kernels.build import (
    VARIANTS,
    HostKernelError,
    HostLibrary,
    build_variant,
    library,
    load,
    probe,
    why_not,
)
from engine.host_kernels.gemm import fp4_linear, fp8_linear, linear, stack_linear
from engine.host_kernels.moe_ops import moe_ffn
from engine.host_kernels.native import MAX_M, _native, build_info, ensure_loaded, max_m, summary
from engine.host_kernels.packs import Pack, packed
from engine.host_kernels.small_ops import (
    compress_pool,
    hc_collapse,
    hc_expand,
    hc_mixes,
    hc_pre,
    index_score,
    index_score_native,
    rms_norm,
    sparse_attn,
)
from engine.host_kernels.table import NATIVE_OPS

__all__ = ["MAX_M", "NATIVE_OPS", "VARIANTS", "HostKernelError", "HostLibrary", "Pack", "_native", "attn_ops",
           "build_info", "build_variant", "compress_pool", "ensure_loaded", "fp4_linear", "fp8_linear", "hc_collapse",
           "hc_expand", "hc_mixes", "hc_pre", "index_score", "index_score_native", "layer_ops", "library", "linear",
           "load", "max_m", "moe_ffn", "packed", "probe", "rms_norm", "sparse_attn", "stack_linear", "step_ops",
           "summary", "why_not"]


class _Package(types.ModuleType):
    """`host_kernels._lib` is native.py's library handle, so callers that swap the process's library keep working."""

    _lib = property(lambda self: native._lib, lambda self, value: setattr(native, "_lib", value))


sys.modules[__name__].__class__ = _Package
