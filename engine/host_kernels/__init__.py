"""Native host kernels of `--kernels host`: C kernels (gemv.c, mhc.c, moe.c, attn.c) built for the best instruction
set this CPU runs and loaded with ctypes (build.py), wrapped as ops with the reference's signatures. Memory-bound
decode on a CPU is why: the kernels read stored FP8 / FP4 / bf16 weights once and run a step's small ops and whole
layers without the Python between torch ops. Modules: native (library handle, row limits), gemm, small_ops,
moe_ops, attn_ops, step_ops, packs + abi + layer_ops (the one-call decode layer), block_decoder (its adapter)."""

from __future__ import annotations

import sys
import types
from collections.abc import Callable
from typing import Any

from engine.host_kernels import attn_ops, layer_ops, native, step_ops
from engine.host_kernels.build import VARIANTS, HostKernelError, HostLibrary, build_variant, library, load, why_not
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

__all__ = ["MAX_M", "NATIVE_OPS", "VARIANTS", "HostKernelError", "HostLibrary", "Pack", "_native", "attn_ops",
           "build_info", "build_variant", "compress_pool", "ensure_loaded", "fp4_linear", "fp8_linear", "hc_collapse",
           "hc_expand", "hc_mixes", "hc_pre", "index_score", "index_score_native", "layer_ops", "library", "linear",
           "load", "max_m", "moe_ffn", "packed", "rms_norm", "sparse_attn", "stack_linear", "step_ops", "summary",
           "why_not"]

# What `--kernels host` replaces in the reference table (engine/model/ops.py `ops_for("host")`).
NATIVE_OPS: dict[str, Callable[..., Any]] = {
    "linear": linear, "fp8_linear": fp8_linear, "fp4_linear": fp4_linear, "hc_mixes": hc_mixes, "rms_norm": rms_norm,
    "hc_collapse": hc_collapse, "hc_expand": hc_expand, "hc_pre": hc_pre, "sparse_attn": sparse_attn,
    "moe_ffn": moe_ffn, "compress_pool": compress_pool, "index_score": index_score, "rope_tail": attn_ops.rope_tail,
    "grouped_out_proj": attn_ops.grouped_out_proj, "gate": step_ops.gate, "hc_head": step_ops.hc_head,
    "attn_qkv_native": attn_ops.attn_qkv_native, "ffn_site": step_ops.ffn_site, "ffn_site_pack": step_ops.site_pack,
    "attn_front": attn_ops.attn_front, "attn_front_pack": attn_ops.front_pack, "attn_decode": attn_ops.attn_decode,
    "attn_decode_pack": attn_ops.decode_pack, "attn_decode_takes": attn_ops.attn_decode_takes, "native_pack": packed,
    "decode_layer": layer_ops.decode_layer, "decode_layer_pack": layer_ops.layer_pack,
    "decode_limits": lambda: (max_m("pool"), max_m("index"))}


class _Package(types.ModuleType):
    """`host_kernels._lib` reads and sets the library handle where it lives (native.py), so code and tests that
    swap the process's library on the package keep working."""

    @property
    def _lib(self) -> Any:
        return native._lib

    @_lib.setter
    def _lib(self, value: Any) -> None:
        native._lib = value


sys.modules[__name__].__class__ = _Package
