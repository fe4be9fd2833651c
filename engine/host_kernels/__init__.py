"""Native host kernels of `--kernels host`: ops with the reference's signatures (NATIVE_OPS), which
engine/model/ops.py `ops_for("host")` puts in place of the reference's in the host op table.

Batch-1 decode on the host is memory-bound, and the reference's stored-weight GEMMs decode FP8/FP4 bytes (and
widen bf16 weights) through torch ops into fp32 chunks before a BLAS call. Here `gemv.c` (C, no torch headers; one
decoder per instruction set: gemv_avx512.h, gemv_avx2.h, a portable one) reads the stored bytes once and decodes
them in registers:

    op            weight                                      native when                dispatch key
    linear        bf16 [N, K] with fp32 x (the V4 head, ...)   M <= max_m("linear")       "host.linear"
    fp8_linear    e4m3 bytes [N, K], UE8M0 [N/128, K/128]     M <= max_m("fp8")          "host.fp8"
    fp4_linear    e2m1 nibbles [N, K/2], UE8M0 [N, K/32]      M <= max_m("fp4")          "host.fp4"

M is the number of x rows (the product of x's leading dims). Every other case runs the reference function itself
(`nki_kernels.reference`), counted by reason under "<key>.fallback" (`dispatch.fallbacks()`): "M > <max>"
(prefill chunks: MKL on dequantised chunks is as fast or faster there), "same dtype" (linear with a weight of x's
dtype: BLAS already reads it once), "dtype" (x not fp32/bf16, or a weight dtype the kernel does not take),
"device", "autograd", "empty". Contracts are the reference's: same signature, leading batch dims, result in
x.dtype (a bf16 x is widened to fp32 first, the fp32 result cast once), fp32 accumulation, the reference's
ValueError on bad shapes. Weight values are decoded exactly as the reference dequantises them, so results differ
by fp32 summation order only.

`mhc.c` holds the small per-token ops of a decode step, which cost microseconds of arithmetic but tens to
hundreds of microseconds as chains of torch ops (on the tiny model they were ~45% of an eager decode step):
`hc_mixes`, `hc_collapse`, `hc_expand` (mHC), `rms_norm` and `sparse_attn` (keys "host.<op>"), native for CPU
fp32 / bf16 inputs of at most max_m("mhc") token rows, else the reference (counted by reason, as above); `hc_pre`
(the front of an mHC site: hc_mixes, hc_collapse, rms_norm) runs those three native calls from one wrapper.
`compress_pool` (attn.c `dk_compress_pool`, key "host.compress_pool"): the compressors' softmax pooling, per channel
with libm's expf, for CPU fp32 / bf16 blocks of any count (the reference's results within (4n + 16) u max|kv| for
n slots: tests/test_host_kernels.py), else the reference. `index_score` (attn.c `dk_index_score`, key
"host.index_score"): the indexer's scores of decode rows (T = 1), four keys by 16 heads at a time in registers;
chunks run the reference's batched matmul.

`attn_ops.py` holds the attention tail's `rope_tail` (mhc.c, bitwise the reference) and `grouped_out_proj` (wo_a
held as bf16 on the bf16 GEMV, gemv.c), keys "host.<op>", and `attn_qkv_native`, the attention's front (the op
table's `attn_qkv`: three GEMVs, two norms, the per-head RMS, two RoPEs) as one call (attn.c `dk_attn_qkv`) over
the same kernels in the same order, key "host.attn_qkv"; `step_ops.py` the MoE router `gate` and the head's
`hc_head` (keys "host.gate", "host.hc_head").

`moe.c` holds the MoE FFN of a decode step after the gate (routed experts in expert order, each on its tokens with
the routing weight before w2, plus the shared expert) as one native call over the same GEMMs (`moe_ffn`, key
"host.moe_ffn"; engine/model/moe.py `MoE.forward` calls it when the op table has it): the ~15 torch ops and op-table
calls per (token, expert) pair were the largest non-GEMM cost of a mid-model batch-1 step. Native for CPU fp32 x of
at most max_m("mhc") rows (and each weight format's own limit), else the module's op-by-op path, counted by reason;
in decode-region graphs (`MoE.forward_static`) the custom op `deepinfer::host_moe_ffn`.

A decode-only eager step runs each layer as one native call (`decode_layer`, layer_ops.py, attn.c
`dk_decode_layer`) of three parts that also run alone: `attn_front` and `attn_decode` (attn_ops.py: the attention
site's front; the state writes, keys, attention and tail) and `ffn_site` (step_ops.py: the MoE half). Each is the
kernels above in the op-by-op order, so the same numbers bit for bit, and each takes a `Pack`: its static
arguments, made once per layer (`packed`) and made again when a tensor they point into has moved. A compressed
block that closes in the step pools inside `attn_decode` (the routine of the table's `compress_pool`). A step where
a layer's indexer selects (contexts past index_topk x ratio) runs that layer's three parts: the indexer's queries
in torch between the first two, its scores and top-k inside `attn_decode` (after the state writes: a block that
closes is scored). Off under
`--numerics official` (engine/model/numerics.py), like `moe_ffn` and `attn_qkv_native`.

Build (engine/host_kernels/build.py): on first use the best variant this CPU runs (avx512-vbmi > avx512 > avx2 >
portable; `build_info()` says which and why, for results metadata) is compiled with DEEPINFER_HOST_CC into
`engine.envs.host_kernel_cache_dir()` and loaded with ctypes. The library's libgomp.so.1 NEEDED entry resolves to
the libgomp torch already loaded (same SONAME), so it shares torch's OpenMP runtime; every call also passes
`torch.get_num_threads()` explicitly. A variant that fails to compile, or that its own cpuid check refuses, is
stepped past to the next (reported as not run, with the compiler's words); a missing compiler, or no variant that
builds, is a `HostKernelError` (a ValueError: one line, exit 2 at the CLI), never a silent fallback.

The GEMMs are torch.library custom ops (`deepinfer::host_*`, with fake implementations), so compiled region
graphs (`--graph-mode layer`) call them without a graph break; in eager mode the wrappers call the same
implementation directly (no custom-op dispatch overhead on the decode hot path). The small ops are custom ops the
same way."""

from __future__ import annotations

import ctypes
import math
from collections.abc import Callable
from typing import Any

import torch

from engine.host_kernels.build import VARIANTS, HostKernelError, HostLibrary, build_variant, library, load, why_not
from engine.host_kernels.build import build_info as _build_info
from engine.host_kernels.build import summary as _summary
from nki_kernels import dispatch, reference

__all__ = ["MAX_M", "NATIVE_OPS", "VARIANTS", "HostKernelError", "HostLibrary", "Pack", "build_info", "build_variant",
           "ensure_loaded", "library", "load", "max_m", "moe_ffn", "packed", "stack_linear", "summary", "why_not"]

# Largest x row count each native kernel takes, per build ("mhc": the small per-token ops but sparse_attn, which has
# its own); above it the reference (MKL on dequantised chunks; torch's batched ops) is as fast or faster.
# scripts/bench_host_kernels.py, 1 thread, the mid-size V4 shapes:
# * avx512 builds (Zen 4): native / reference at M = 128: head 1.1x, FP8 1.3x, FP4 1.9x faster; at 256: head 0.88x,
#   FP8 0.9-0.97x, FP4 1.26x. From M ~ 4 on both are FMA-bound; the crossover is where the reference's one-off
#   decode / widening of the weight stops paying for MKL's faster GEMM.
# * avx2 (Zen 3, 2 cores shared with other jobs): head 3.0x at 32, 0.84x at 64; FP8 1.05-1.7x at 64, 0.5-0.9x at 128;
#   FP4 1.0-2.0x at 128, 0.7x at 256; small ops 1.7-2.3x and sparse_attn 1.3x at 64. A later run (2026-12-03, load
#   ~9 on the 2 cores, interleaved): FP8 1.3-5.3x at 32 but 0.94-0.99x (fp8_4096, wo_b) at 64, hence FP8 <= 32.
#   2026-12-04 (load ~2.5): the bf16 kernel with two weight rows per tile: head 2.0-2.6x at 8-16, 2.13x at 64,
#   hence linear <= 64; sparse_attn 1.00-1.10x at 8-16 but 0.80-0.91x at 32-64 (q [1, T, 16, 128], 384 keys),
#   hence sparse_attn <= 16. 2026-12-04 after the FP8 / FP4 decode rework (load ~0, cold weights): head 22.6x at 1,
#   2.51x at 8, 1.34x at 32 but 0.98x at 64, hence linear <= 32; FP8 5.4-6.1x at 8, 1.6-1.8x at 32, 1.04-1.09x at
#   64; FP4 11.5x at 8, 3.2-3.4x at 32, 1.6-1.9x at 64. 2026-12-05, sparse_attn taking two heads per pass over the
#   keys (1.34-1.43x a call; measured on the Zen 4 box with the avx2 build, not on Zen 3): 1.33x at 8, 1.18x at 16,
#   1.05-1.08x at 32-64, 1.01x at 128 (avx512-vbmi alike), hence sparse_attn <= 64.
# * portable (no AVX2): 1.7-8x at M = 1, but head 0.81x and FP8 0.44-2.2x at 4, FP4 6.9x at 4 and 0.6x at 16,
#   sparse_attn 0.93-1.08x at 1 (0: never native) and 0.45x at 4; the other small ops 1.5-3x up to 64.
# * "pool" (compress_pool: rows = pooled entries) and "index" (index_score: decode rows), 2026-12-05 on the Zen 4
#   box, one thread, the mid shapes (a CSA block of 2 x 4 slots x 128 channels; 32 heads x 128 over 275 entries):
#   compress_pool 1.6-1.7x at 1, 1.2-1.4x at 2, 0.9-1.0x at 4, 0.7-0.8x at 8 in every build (libm's expf, one
#   channel at a time), hence pool <= 2; index_score avx512-vbmi 1.53x at 1, 1.15-1.34x at 2-8, avx2 1.02x at 1 and
#   0.73-0.87x at 2-8, portable 0.30-0.59x, hence index <= 8 / 1 / 0. The decode step takes the same limits
#   (`decode_limits`), so its native path and the ops one by one stay the same numbers.
_AVX512_MAX_M = {"linear": 128, "fp8": 128, "fp4": 256, "mhc": 64, "sparse_attn": 64, "pool": 2, "index": 8}
MAX_M = {"avx512-vbmi": dict(_AVX512_MAX_M), "avx512": dict(_AVX512_MAX_M),
         "avx2": {"linear": 32, "fp8": 32, "fp4": 128, "mhc": 64, "sparse_attn": 64, "pool": 2, "index": 1},
         "portable": {"linear": 1, "fp8": 1, "fp4": 4, "mhc": 64, "sparse_attn": 0, "pool": 2, "index": 0}}
EXECUTOR = "host"  # the executor column of the dispatch counters
F32 = torch.float32  # every output buffer the native code writes is allocated with this dtype, never the default
# one (torch.set_default_dtype(torch.bfloat16), as DeepSeek's own inference code sets it, would hand the kernels
# half-sized buffers); as ints, not a torch.Size: torch.empty(*shape, dtype=F32) costs ~1.5 us, (shape, dtype=F32) ~3


def max_m(key: str) -> int:
    """The largest row count the native `key` kernel takes in the build this process runs (MAX_M)."""
    return MAX_M[_native().variant][key]


def build_info() -> dict[str, Any]:
    """Which build `--kernels host` runs in this process and why (build.build_info, with the library loaded here)."""
    return _build_info(_lib)


def summary() -> str:
    """One line: the chosen build and every other build's status (build.summary)."""
    return _summary(build_info())


# ---------------------------------------------------------------------------------------------------------------
# Implementations (run eagerly, and as the bodies of the custom ops inside compiled graphs)

_lib: HostLibrary | None = None


def _native() -> HostLibrary:
    global _lib
    if _lib is None:
        _lib = library()
    return _lib


def _why_not_rows(key: str, rows: int, x: torch.Tensor, *others: torch.Tensor | None) -> str | None:
    """Why a native kernel does not take this call (None: it does): x's dtype, every tensor's device, autograd, an
    empty x, or more than max_m(key) rows (x's token / row count `rows`). On the decode hot path (~70 calls a
    step): plain loops, no generator per call."""
    if x.dtype is not torch.float32 and x.dtype is not torch.bfloat16:
        return "dtype"
    if not x.is_cpu:
        return "device"
    for t in others:
        if t is not None and not t.is_cpu:
            return "device"
    if torch.is_grad_enabled() and (x.requires_grad or any(t is not None and t.requires_grad for t in others)):
        return "autograd"
    if x.numel() == 0:
        return "empty"
    if rows > (limit := MAX_M[_native().variant][key]):
        return f"M > {limit}"
    return None


def _why_not(op: str, x: torch.Tensor, w: torch.Tensor, s: torch.Tensor | None = None) -> str | None:
    """`_why_not_rows` for a GEMM (rows: the product of x's leading dims), and an empty weight."""
    why = _why_not_rows(op, x.numel() // x.shape[-1] if x.numel() else 0, x, w, s)
    return "empty" if why is None and w.numel() == 0 else why


def _f32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype is torch.float32 and t.is_contiguous() else t.float().contiguous()


def _count(key: str) -> None:
    dispatch.current().count(key, EXECUTOR)


def _count_each(keys: tuple[tuple[str, str], ...]) -> None:
    """Count every (key, executor) of `keys` (a pack's: made once) in the active dispatcher."""
    dispatch.current().count_each(keys)


def _run(fmt: str, x: torch.Tensor, w: torch.Tensor, s: torch.Tensor | None, n: int) -> torch.Tensor:
    k = x.shape[-1]
    xf = _f32(x)
    if not w.is_contiguous():
        w = w.contiguous()
    if s is not None and not s.is_contiguous():
        s = s.contiguous()
    y = torch.empty(*x.shape[:-1], n, dtype=F32)
    _native().gemv(fmt, xf, w, s, y, xf.numel() // k, n, k)
    return y if x.dtype is torch.float32 else y.to(x.dtype)


def linear_impl(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    why = _why_not("linear", x, weight)
    if why is None and x.dtype != torch.float32:
        why = "dtype"  # a bf16 weight with bf16 x is the same-dtype case below; bf16 x with another weight: ref
    if why is None and weight.dtype != torch.bfloat16:
        why = "same dtype" if weight.dtype == x.dtype else "dtype"
    if why is not None:
        return dispatch.fallback("host.linear", why, lambda: reference.linear(x, weight))
    _count("host.linear")
    return _run("bf16", x, weight, None, weight.shape[0])


def _quant_linear(fmt: str, x: torch.Tensor, w_u8: torch.Tensor, scale_u8: torch.Tensor,
                  ref: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """A stored-format GEMM (fmt fp8 | fp4: uint8 weight bytes + UE8M0 scale bytes) natively, else `ref`."""
    why = _why_not(fmt, x, w_u8, scale_u8)
    if why is None and (w_u8.dtype != torch.uint8 or scale_u8.dtype != torch.uint8):
        why = "dtype"
    if why is not None:
        return dispatch.fallback(f"host.{fmt}", why, lambda: ref(x, w_u8, scale_u8))
    _count(f"host.{fmt}")
    return _run(fmt, x, w_u8, scale_u8, w_u8.shape[0])


def fp8_linear_impl(x: torch.Tensor, w_u8: torch.Tensor, scale_u8: torch.Tensor) -> torch.Tensor:
    return _quant_linear("fp8", x, w_u8, scale_u8, reference.fp8_linear)


def fp4_linear_impl(x: torch.Tensor, packed_u8: torch.Tensor, scale_u8: torch.Tensor) -> torch.Tensor:
    return _quant_linear("fp4", x, packed_u8, scale_u8, reference.fp4_linear)


# ---------------------------------------------------------------------------------------------------------------
# Custom ops (what a compiled graph calls) and the op-table wrappers

@torch.library.custom_op("deepinfer::host_linear", mutates_args=())
def _linear_op(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return linear_impl(x, weight)


@torch.library.custom_op("deepinfer::host_fp8_linear", mutates_args=())
def _fp8_op(x: torch.Tensor, w_u8: torch.Tensor, scale_u8: torch.Tensor) -> torch.Tensor:
    return fp8_linear_impl(x, w_u8, scale_u8)


@torch.library.custom_op("deepinfer::host_fp4_linear", mutates_args=())
def _fp4_op(x: torch.Tensor, packed_u8: torch.Tensor, scale_u8: torch.Tensor) -> torch.Tensor:
    return fp4_linear_impl(x, packed_u8, scale_u8)


def _fake(x: torch.Tensor, w: torch.Tensor, *_: torch.Tensor) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], w.shape[0]))


for _op in (_linear_op, _fp8_op, _fp4_op):
    _op.register_fake(_fake)


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`reference.linear` with a bf16 weight and fp32 x on the native kernel (see the module docstring)."""
    if weight.dim() != 2 or x.dim() == 0 or x.shape[-1] != weight.shape[-1]:
        return reference.linear(x, weight)  # raises the reference's error
    if weight.dtype == x.dtype:  # BLAS reads the weight once, as it is
        if torch.compiler.is_compiling():
            return reference.linear(x, weight)
        return dispatch.fallback("host.linear", "same dtype", lambda: reference.linear(x, weight))
    if torch.compiler.is_compiling():
        return torch.ops.deepinfer.host_linear(x, weight)
    return linear_impl(x, weight)


def fp8_linear(x: torch.Tensor, w_u8: torch.Tensor, scale_u8: torch.Tensor) -> torch.Tensor:
    """`reference.fp8_linear` on the native kernel (see the module docstring)."""
    n, k = w_u8.shape
    if tuple(scale_u8.shape) != (-(-n // 128), -(-k // 128)) or x.dim() == 0 or x.shape[-1] != k:
        return reference.fp8_linear(x, w_u8, scale_u8)  # raises the reference's ValueError
    if torch.compiler.is_compiling():
        return torch.ops.deepinfer.host_fp8_linear(x, w_u8, scale_u8)
    return fp8_linear_impl(x, w_u8, scale_u8)


def fp4_linear(x: torch.Tensor, packed_u8: torch.Tensor, scale_u8: torch.Tensor) -> torch.Tensor:
    """`reference.fp4_linear` on the native kernel (see the module docstring)."""
    n, k = packed_u8.shape[0], packed_u8.shape[1] * 2
    if k % 32 or tuple(scale_u8.shape) != (n, k // 32) or x.dim() == 0 or x.shape[-1] != k:
        return reference.fp4_linear(x, packed_u8, scale_u8)  # raises the reference's ValueError
    if torch.compiler.is_compiling():
        return torch.ops.deepinfer.host_fp4_linear(x, packed_u8, scale_u8)
    return fp4_linear_impl(x, packed_u8, scale_u8)


# ---------------------------------------------------------------------------------------------------------------
# The small per-token ops (mhc.c): mHC mixing weights, collapse and expand, RMSNorm, sparse attention. Native for
# CPU fp32 / bf16 inputs of at most max_m("mhc") rows outside autograd; else the reference, counted by reason like
# the GEMMs. Custom ops like the GEMMs, so compiled region graphs call the same native code.


def hc_mixes_impl(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, hc_mult: int,
                  iters: int, hc_eps: float, norm_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`reference.hc_mixes` natively (mhc.c); x [T, n, D]."""
    def ref():
        return reference.hc_mixes(x, fn, scale, base, hc_mult, iters, hc_eps, norm_eps)

    why = _why_not_rows("mhc", x.shape[0] if x.dim() else 0, x, fn, scale, base)
    n = hc_mult
    if why is None and (x.dim() != 3 or x.shape[1] != n or not 0 < n <= 16
                        or tuple(fn.shape) != ((2 + n) * n, n * x.shape[2]) or scale.numel() < 3
                        or base.numel() != (2 + n) * n):
        why = "shape"
    if why is not None:
        return dispatch.fallback("host.hc_mixes", why, ref)
    _count("host.hc_mixes")
    t, _, d = x.shape
    xf, fnf, sf, bf = _f32(x), _f32(fn), _f32(scale), _f32(base)
    pre, post, comb = torch.empty(t, n, dtype=F32), torch.empty(t, n, dtype=F32), torch.empty(t, n, n, dtype=F32)
    _native().lib.dk_hc_mixes(xf.data_ptr(), fnf.data_ptr(), sf.data_ptr(), bf.data_ptr(), pre.data_ptr(),
                              post.data_ptr(), comb.data_ptr(), t, n, d, iters, hc_eps, norm_eps,
                              torch.get_num_threads())
    return pre, post, comb


def hc_pre_impl(x: torch.Tensor, fn: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, norm_w: torch.Tensor,
                hc_mult: int, iters: int, hc_eps: float,
                norm_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The front of an mHC site (engine/model/ops.py `hc_pre`: hc_mixes, hc_collapse with its pre, rms_norm) as one
    native call for fp32 x [T, n, D] (mhc.c `dk_hc_pre`: the three kernels in a row, as dk_ffn_site and
    dk_attn_front call them too): the same native code as the three ops one by one (so the same numbers), without
    two of their three Python wrappers (an mHC site runs twice per layer and step). Counted
    under each op's own key; any other case runs the three ops one by one (each natively or not, as it decides)."""
    n = hc_mult
    why = _why_not_rows("mhc", x.shape[0] if x.dim() else 0, x, fn, scale, base, norm_w)
    if why is None and (x.dtype is not torch.float32 or x.dim() != 3 or x.shape[1] != n or not 0 < n <= 16
                        or tuple(fn.shape) != ((2 + n) * n, n * x.shape[2]) or scale.numel() < 3
                        or base.numel() != (2 + n) * n or tuple(norm_w.shape) != (x.shape[2],)):
        why = "shape"
    if why is not None:
        pre, post, comb = hc_mixes(x, fn, scale, base, hc_mult, iters, hc_eps, norm_eps)
        return rms_norm(hc_collapse(x, pre), norm_w, norm_eps), post, comb
    for key in ("host.hc_mixes", "host.hc_collapse", "host.rms_norm"):
        _count(key)
    t, _, d = x.shape
    xf, fnf, sf, bf, wf = _f32(x), _f32(fn), _f32(scale), _f32(base), _f32(norm_w)
    pre, post, comb = torch.empty(t, n, dtype=F32), torch.empty(t, n, dtype=F32), torch.empty(t, n, n, dtype=F32)
    h, y = torch.empty(t, d, dtype=F32), torch.empty(t, d, dtype=F32)
    _native().lib.dk_hc_pre(xf.data_ptr(), fnf.data_ptr(), sf.data_ptr(), bf.data_ptr(), wf.data_ptr(), pre.data_ptr(),
                            post.data_ptr(), comb.data_ptr(), h.data_ptr(), y.data_ptr(), t, n, d, iters, hc_eps,
                            norm_eps, torch.get_num_threads())
    return y, post, comb


def rms_norm_impl(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """`reference.rms_norm` natively (mhc.c)."""
    if x.dim() == 0 or weight is not None and (weight.dim() != 1 or weight.shape[0] != x.shape[-1]):
        return reference.rms_norm(x, weight, eps)  # the reference's behaviour (or error) for odd shapes
    why = _why_not_rows("mhc", x.numel() // max(1, x.shape[-1]), x, weight)
    if why is not None:
        return dispatch.fallback("host.rms_norm", why, lambda: reference.rms_norm(x, weight, eps))
    _count("host.rms_norm")
    d = x.shape[-1]
    xf = _f32(x)
    w = _f32(weight) if weight is not None else None
    y = torch.empty(*x.shape, dtype=F32)
    _native().lib.dk_rms_norm(xf.data_ptr(), w.data_ptr() if w is not None else None, y.data_ptr(),
                              xf.numel() // d, d, eps, torch.get_num_threads())
    return y if x.dtype is torch.float32 else y.to(x.dtype)


def hc_collapse_impl(x: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """`reference.hc_collapse` natively (mhc.c); x [T, n, D], pre [T, n]."""
    why = _why_not_rows("mhc", x.shape[0] if x.dim() else 0, x, pre)
    if why is None and (x.dim() != 3 or tuple(pre.shape) != tuple(x.shape[:2])):
        why = "shape"
    if why is not None:
        return dispatch.fallback("host.hc_collapse", why, lambda: reference.hc_collapse(x, pre))
    _count("host.hc_collapse")
    t, n, d = x.shape
    xf, pf = _f32(x), _f32(pre)
    y = torch.empty(t, d, dtype=F32)
    _native().lib.dk_hc_collapse(xf.data_ptr(), pf.data_ptr(), y.data_ptr(), t, n, d, torch.get_num_threads())
    return y if x.dtype is torch.float32 else y.to(x.dtype)


def hc_expand_impl(y: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """`reference.hc_expand` natively (mhc.c); y [T, D], residual [T, n, D], post [T, n], comb [T, n, n]."""
    why = _why_not_rows("mhc", residual.shape[0] if residual.dim() else 0, residual, y, post, comb)
    if why is None and y.dtype is not torch.float32 and y.dtype is not torch.bfloat16:
        why = "dtype"
    if why is None:
        t, n, d = residual.shape if residual.dim() == 3 else (0, 0, 0)
        if residual.dim() != 3 or tuple(y.shape) != (t, d) or tuple(post.shape) != (t, n) or \
                tuple(comb.shape) != (t, n, n):
            why = "shape"
    if why is not None:
        return dispatch.fallback("host.hc_expand", why, lambda: reference.hc_expand(y, residual, post, comb))
    _count("host.hc_expand")
    yf, xf, pf, cf = _f32(y), _f32(residual), _f32(post), _f32(comb)
    out = torch.empty(t, n, d, dtype=F32)
    _native().lib.dk_hc_expand(yf.data_ptr(), xf.data_ptr(), pf.data_ptr(), cf.data_ptr(), out.data_ptr(), t, n, d,
                               torch.get_num_threads())
    return out if y.dtype is torch.float32 else out.to(y.dtype)


def sparse_attn_impl(q: torch.Tensor, kv: torch.Tensor, valid: torch.Tensor, sink: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """`reference.sparse_attn` natively (mhc.c); q [B, T, H, D], kv [B, N, D], valid [B, T, N], sink [H]."""
    def ref():
        return reference.sparse_attn(q, kv, valid, sink, scale)

    why = _why_not_rows("sparse_attn", q.shape[0] * q.shape[1] if q.dim() == 4 else 0, q, kv, valid, sink)
    if why is None and kv.dtype is not torch.float32 and kv.dtype is not torch.bfloat16:
        why = "dtype"
    if why is None:
        b, t, h, d = q.shape if q.dim() == 4 else (0, 0, 0, 0)
        n = kv.shape[1] if kv.dim() == 3 else -1
        if q.dim() != 4 or tuple(kv.shape) != (b, n, d) or tuple(valid.shape) != (b, t, n) or \
                valid.dtype is not torch.bool or tuple(sink.shape) != (h,):
            why = "shape"
    if why is not None:
        return dispatch.fallback("host.sparse_attn", why, ref)
    _count("host.sparse_attn")
    qf, kf, sf = _f32(q), _f32(kv), _f32(sink)
    vb = valid.contiguous()
    nt = torch.get_num_threads()
    o = torch.empty(b, t, h, d, dtype=F32)
    lib = _native()
    scratch = torch.empty(max(1, 2 * lib.attn_heads * nt * n), dtype=F32)
    if lib.lib.dk_sparse_attn(qf.data_ptr(), kf.data_ptr(), vb.data_ptr(), sf.data_ptr(), o.data_ptr(),
                              scratch.data_ptr(), scratch.numel(), b, t, h, n, d, scale, nt) != 0:
        raise RuntimeError(f"host kernel sparse_attn: scratch of {scratch.numel()} floats is too small")
    return o if q.dtype is torch.float32 else o.to(q.dtype)


def compress_pool_impl(kv: torch.Tensor, score: torch.Tensor, overlap: bool, prev_kv: torch.Tensor | None = None,
                       prev_score: torch.Tensor | None = None) -> torch.Tensor:
    """`reference.compress_pool` natively (attn.c dk_compress_pool: per channel, the slots' max, libm expf, the
    softmax's weights, the weighted sum; the decode step's closing blocks in `dk_attn_decode` pool with the same
    routine): kv, score [..., W, m, C], prev_kv / prev_score [..., m, C] or None -> [..., W, d] fp32."""
    def ref():
        return reference.compress_pool(kv, score, overlap, prev_kv, prev_score)

    why = None
    lead = tuple(kv.shape[:-3])
    if kv.dim() < 3 or score.shape != kv.shape or (prev_kv is None) != (prev_score is None) \
            or overlap and kv.shape[-1] % 2 or kv.shape[-2] * (2 if overlap else 1) > _native().pool_slots \
            or prev_kv is not None and overlap and (
                tuple(prev_kv.shape) != (*lead, *kv.shape[-2:]) or prev_score.shape != prev_kv.shape):
        why = "shape"
    elif any(t is not None and (not t.is_cpu or t.dtype not in (torch.float32, torch.bfloat16))
             for t in (kv, score, prev_kv, prev_score)):
        why = "dtype"
    elif torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (kv, score, prev_kv, prev_score)):
        why = "autograd"
    elif kv.numel() == 0:
        why = "empty"
    elif math.prod(kv.shape[:-2]) > (limit := max_m("pool")):
        why = f"M > {limit}"
    if why is not None:
        return dispatch.fallback("host.compress_pool", why, ref)
    _count("host.compress_pool")
    w, m, c = kv.shape[-3:]
    n = math.prod(lead)
    d = c // 2 if overlap else c
    kf, sf = _f32(kv), _f32(score)
    pk, ps = (_f32(prev_kv), _f32(prev_score)) if overlap and prev_kv is not None else (None, None)
    out = torch.empty(*lead, w, d, dtype=F32)
    if _native().lib.dk_compress_pool(kf.data_ptr(), sf.data_ptr(), pk.data_ptr() if pk is not None else None,
                                      ps.data_ptr() if ps is not None else None, n, w, m, c, int(overlap),
                                      out.data_ptr()) != 0:
        raise MemoryError("host kernel compress_pool: out of memory")
    return out


def index_score_impl(q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """`reference.index_score` natively for decode rows (attn.c dk_index_score: per entry, every head's dot in one
    pass over the key, the weighted ReLU sum in head order; the routine dk_attn_decode selects with): q [B, 1, Hi,
    Di], keys [B, N, Di], weights [B, 1, Hi] -> [B, 1, N] fp32. Prefill chunks (T > 1) run the reference (one batched
    matmul there)."""
    def ref():
        return reference.index_score(q, keys, weights)

    why = None
    if q.dim() != 4 or keys.dim() != 3 or weights.dim() != 3:
        why = "shape"
    else:
        b, t, hi, di = q.shape
        if t != 1:
            why = "T > 1"
        elif keys.shape[0] != b or keys.shape[2] != di or tuple(weights.shape) != (b, t, hi):
            why = "shape"
        elif any(not x.is_cpu or x.dtype not in (torch.float32, torch.bfloat16) for x in (q, keys, weights)):
            why = "dtype"
        elif torch.is_grad_enabled() and any(x.requires_grad for x in (q, keys, weights)):
            why = "autograd"
        elif keys.shape[1] == 0 or q.numel() == 0:
            why = "empty"
        elif b > (limit := max_m("index")):
            why = f"M > {limit}"
    if why is not None:
        return dispatch.fallback("host.index_score", why, ref)
    _count("host.index_score")
    return index_score_native(q, keys, weights)


def index_score_native(q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """dk_index_score itself, whatever the row limit (`index_score_impl` checked the rest): the scores
    `attn_decode` picks by."""
    b, t, hi, di = q.shape
    n = keys.shape[1]
    qT = q.float().transpose(-1, -2).contiguous()  # [B, T, Di, Hi]
    kf, wf = _f32(keys), _f32(weights)
    out = torch.empty(b, t, n, dtype=F32)
    if _native().lib.dk_index_score(qT.data_ptr(), kf.data_ptr(), wf.data_ptr(), b, t, n, hi, di,
                                    out.data_ptr()) != 0:
        raise MemoryError("host kernel index_score: out of memory")
    return out


def stack_linear_impl(x: torch.Tensor, stack: torch.Tensor, scales: torch.Tensor | None, i: torch.Tensor,
                      fmt: str | None) -> torch.Tensor:
    """The reference table's `stack_linear` (engine/model/ops.py) on the host's GEMMs, reading expert i's weight
    where it lies in the stack (the index is a CPU tensor: reading it costs nothing) instead of gathering a copy."""
    e = int(i.reshape(-1)[0])
    if fmt is None:
        return linear(x, stack[e])
    return (fp8_linear if fmt == "fp8" else fp4_linear)(x, stack[e], scales[e])


_FMT_CODE = {None: 0, "fp8": 1, "fp4": 2}  # the native weight formats (dk.h gemm: moe.c, attn.c)
_FMT_DTYPE = {None: torch.bfloat16, "fp8": torch.uint8, "fp4": torch.uint8}
_FMT_KEY = {None: "linear", "fp8": "fp8", "fp4": "fp4"}


class Pack:
    """The static arguments of one layer's native call (pointers, formats, sizes, ctypes arrays: `args`; None where
    the kernels do not take these tensors), made once by an op's `*_pack` builder and kept by the module that
    calls it (`packed`). It holds every tensor its pointers point into, so they live as long as it does, and is
    made again when one of them has moved (`Tensor.set_`, `.data =`: `fresh`). A pack is made at a module's first
    decode step, when its weights are final (engine/runner.py places them before any kernel takes an address)."""

    __slots__ = ("_held", "args", "tag")

    def __init__(self, args: Any, held: tuple[torch.Tensor | None, ...]) -> None:
        self.args, self.tag = args, None
        self._held = tuple((t, t.data_ptr()) for t in held if t is not None)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The tensors the pack holds."""
        return tuple(t for t, _ in self._held)

    def fresh(self) -> bool:
        for t, ptr in self._held:
            if t.data_ptr() != ptr:
                return False
        return True


def _same(a: object, b: object) -> bool:
    """a is b, or both tuples of the same objects."""
    if a is b:
        return True
    return isinstance(a, tuple) and isinstance(b, tuple) and len(a) == len(b) and all(
        u is v for u, v in zip(a, b, strict=True))


def packed(owner: torch.nn.Module, key: str, make: Callable[[], Pack], tag: object = None) -> Pack:
    """owner's pack `key`, made by `make()` the first time and again once it is not `fresh` or was made for another
    `tag` (an object the pack's tensors come from besides the owner's, e.g. a layer's KV cache: compared by
    identity, and kept alive by the pack)."""
    packs = owner.__dict__.get("_native_packs")
    if packs is None:
        packs = owner.__dict__["_native_packs"] = {}
    pack = packs.get(key)
    if pack is None or not _same(pack.tag, tag) or not pack.fresh():
        pack = packs[key] = make()
        pack.tag = tag
    return pack


def held(lin: torch.nn.Module) -> tuple[torch.Tensor, ...]:
    """The tensors a Linear's native GEMV reads (weight, and scale for a stored one): what a pack holds for it."""
    return (lin.weight, lin.scale) if lin.fmt is not None else (lin.weight,)


def step_rows(a: Any, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> int | None:
    """The row count B of x [B, n, dim] when a packed call with static arguments `a` (n, dim, rd, limit_keys) takes
    x and the RoPE tables cos / sin [B, rd/2] (`rows_ok`, within every kernel's max_m), else None."""
    b = x.shape[0] if x.dim() == 3 else 0
    limit = min(max_m(k) for k in a.limit_keys)
    ok = rows_ok(x, (b, a.n, a.dim), limit) and rows_ok(cos, (b, a.rd // 2), limit) \
        and rows_ok(sin, (b, a.rd // 2), limit)
    return b if ok else None


def fp32_cpu(*ts: torch.Tensor) -> bool:
    """Every tensor of `ts` is fp32, contiguous and on the CPU: what a pack's static tensors must be."""
    return all(t.dtype is F32 and t.is_contiguous() and t.is_cpu for t in ts)


def rows_ok(x: torch.Tensor, shape: tuple[int, ...], limit: int) -> bool:
    """x is a CPU fp32 contiguous tensor of `shape` with 1..limit rows, outside autograd: the per-call check of a
    packed native call."""
    return x.dtype is F32 and x.is_cpu and tuple(x.shape) == shape and 0 < shape[0] <= limit \
        and x.is_contiguous() and not (x.requires_grad and torch.is_grad_enabled())


def _moe_why_not(x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor,
                 parts: list[tuple[str | None, tuple[torch.Tensor | None, ...]]]) -> str | None:
    """Why `moe_ffn` does not take this call natively (None: it does); reads metadata only (works on the fake
    tensors of a graph being traced)."""
    t = x.shape[0] if x.dim() == 2 else 0
    why = _why_not_rows("mhc", t, x, weights, indices)
    if why is None and (x.dtype is not torch.float32 or weights.dtype is not torch.float32
                        or indices.dtype is not torch.int64):
        why = "dtype"
    if why is None and (x.dim() != 2 or weights.shape != indices.shape or indices.dim() != 2
                        or indices.shape[0] != t):
        why = "shape"
    return why if why is not None else _moe_weights_why_not(t, parts)


def _moe_weights_why_not(t: int, parts: list[tuple[str | None, tuple[torch.Tensor | None, ...]]]) -> str | None:
    """`_moe_why_not`'s checks of the expert weights (`parts`: routed, then shared) for t token rows."""
    for fmt, ts in parts:
        if fmt not in _FMT_CODE or ts[0].dtype is not _FMT_DTYPE[fmt] or ts[2].dtype is not _FMT_DTYPE[fmt] \
                or ts[4].dtype is not _FMT_DTYPE[fmt] or any(u is not None and not u.is_contiguous() for u in ts):
            return "dtype"
        if ts[0].shape[-2] != parts[0][1][0].shape[-2]:
            return "shape"
        if t > max_m(_FMT_KEY[fmt]):
            return f"M > {max_m(_FMT_KEY[fmt])}"
    return None


def moe_ffn(x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, limit: float, e_lo: int,
            routed: tuple[str | None, tuple[torch.Tensor | None, ...]],
            shared: tuple[str | None, tuple[torch.Tensor | None, ...]] | None,
            ref: Callable[[], torch.Tensor]) -> torch.Tensor:
    """The MoE FFN of a decode step (engine/model/moe.py `MoE.forward` after the gate: routed experts + shared
    expert) as one native call (moe.c `dk_moe_ffn`), else `ref()` (the module's own op-by-op path), counted by
    reason under "host.moe_ffn". x [T, D] fp32, weights / indices [T, K] (fp32 / int64) -> fp32 [T, D].
    `routed` = (fmt, (w1, s1, w3, s3, w2, s2)): the local experts' stacks [E_local, ...] from expert e_lo on, scales
    None for bf16 weights (fmt None); `shared` the same for the shared expert's [I, D] / [D, I] tensors (None: no
    shared expert). The GEMMs are the ones `linear` / `fp8_linear` / `fp4_linear` run, in the module's order, so
    results equal the op-by-op host path up to silu's exp (libm's expf, within an ulp or two). Inside a graph being
    compiled (decode regions: `MoE.forward_static`) the native call is the custom op `deepinfer::host_moe_ffn`."""
    parts = [routed] + ([shared] if shared is not None else [])
    why = _moe_why_not(x, weights, indices, parts)
    if torch.compiler.is_compiling():  # decided on the traced shapes; counted when the op runs
        if why is not None:
            return ref()
        return torch.ops.deepinfer.host_moe_ffn(x, weights, indices, limit, e_lo, routed[0] or "", list(routed[1]),
                                                shared[0] or "" if shared else "", list(shared[1]) if shared else [])
    if why is not None:
        return dispatch.fallback("host.moe_ffn", why, ref)
    return _moe_ffn_native(x, weights, indices, limit, e_lo, routed, shared)


def _moe_ffn_native(x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, limit: float, e_lo: int,
                    routed: tuple[str | None, tuple[torch.Tensor | None, ...]],
                    shared: tuple[str | None, tuple[torch.Tensor | None, ...]] | None) -> torch.Tensor:
    _count("host.moe_ffn")
    parts = [routed] + ([shared] if shared is not None else [])
    t = x.shape[0]
    fmt_r, rw = routed
    e_n, inter = rw[0].shape[0], rw[0].shape[1]
    d, k = x.shape[1], indices.shape[1]
    xf, wf, idx = x.contiguous(), weights.contiguous(), indices.contiguous()
    y = torch.empty(t, d, dtype=F32)
    ptrs = [(ctypes.c_void_p * 6)(*[u.data_ptr() if u is not None else None for u in ts]) for _, ts in parts]
    rc = _native().lib.dk_moe_ffn(
        xf.data_ptr(), t, d, inter, limit, idx.data_ptr(), wf.data_ptr(), k, e_lo, e_n, _FMT_CODE[fmt_r], ptrs[0],
        _FMT_CODE[shared[0]] if shared is not None else 0, ptrs[1] if shared is not None else None, y.data_ptr(),
        torch.get_num_threads())
    if rc != 0:
        raise MemoryError(f"host kernel moe_ffn: out of memory for x [{t}, {d}]")
    return y


@torch.library.custom_op("deepinfer::host_moe_ffn", mutates_args=())
def _moe_ffn_op(x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, limit: float, e_lo: int, fmt_r: str,
                routed: list[torch.Tensor | None], fmt_s: str, shared: list[torch.Tensor | None]) -> torch.Tensor:
    """`moe_ffn`'s native call in a compiled graph (the caller checked `_moe_why_not` on the traced shapes)."""
    return _moe_ffn_native(x, weights, indices, limit, e_lo, (fmt_r or None, tuple(routed)),
                           (fmt_s or None, tuple(shared)) if shared else None)


_moe_ffn_op.register_fake(lambda x, *_: x.new_empty(x.shape))


def _native_op(name: str, impl: Callable[..., Any], fake: Callable[..., Any]) -> Callable[..., Any]:
    """`impl` registered as the custom op `deepinfer::host_<name>` (shapes from `fake`), and the op table's entry
    point: the custom op while torch.compile traces (compiled graphs call the same native code without a graph
    break), `impl` itself otherwise (no custom-op dispatch on the eager decode path)."""
    op = torch.library.custom_op(f"deepinfer::host_{name}", impl, mutates_args=())
    op.register_fake(fake)

    def call(*args: Any) -> Any:
        return op(*args) if torch.compiler.is_compiling() else impl(*args)

    call.__name__, call.__doc__ = name, impl.__doc__
    return call


def _mixes_fake(x, fn, scale, base, hc_mult, *_):
    t, n = x.shape[0], hc_mult
    return x.new_empty(t, n, dtype=torch.float32), x.new_empty(t, n, dtype=torch.float32), \
        x.new_empty(t, n, n, dtype=torch.float32)


hc_mixes = _native_op("hc_mixes", hc_mixes_impl, _mixes_fake)
rms_norm = _native_op("rms_norm", rms_norm_impl, lambda x, weight, eps: torch.empty_like(x))
hc_collapse = _native_op("hc_collapse", hc_collapse_impl, lambda x, pre: x.new_empty(x.shape[0], x.shape[2]))
hc_expand = _native_op("hc_expand", hc_expand_impl, lambda y, residual, post, comb: y.new_empty(residual.shape))
sparse_attn = _native_op("sparse_attn", sparse_attn_impl, lambda q, kv, valid, sink, scale: torch.empty_like(q))
hc_pre = _native_op("hc_pre", hc_pre_impl, lambda x, fn, scale, base, norm_w, hc_mult, *_: (
    x.new_empty(x.shape[0], x.shape[2]), *_mixes_fake(x, fn, scale, base, hc_mult)[1:]))
compress_pool = _native_op("compress_pool", compress_pool_impl, lambda kv, score, overlap, *_: kv.new_empty(
    (*kv.shape[:-2], kv.shape[-1] // 2 if overlap else kv.shape[-1]), dtype=torch.float32))
index_score = _native_op("index_score", index_score_impl,
                         lambda q, keys, weights: q.new_empty(*q.shape[:2], keys.shape[1], dtype=torch.float32))
stack_linear = _native_op("stack_linear", stack_linear_impl,
                          lambda x, stack, scales, i, fmt: x.new_empty((*x.shape[:-1], stack.shape[1])))

from engine.host_kernels import attn_ops, layer_ops, step_ops  # noqa: E402  (their ops are built on the helpers above)

# What `--kernels host` replaces in the reference table (engine/model/ops.py `ops_for("host")` assembles the table:
# these ops, the reference's others, the composites over them, and `stack_linear` reading the stack in place).
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


def ensure_loaded() -> HostLibrary:
    """Build / load the process's library now (a missing compiler fails here with one line, not at the first
    forward)."""
    return _native()
