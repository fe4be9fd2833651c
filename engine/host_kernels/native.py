"""The process's host-kernel library handle, each build's row limits (MAX_M) and the helpers every wrapper
shares: why a native kernel declines a call, the dispatch counters, custom-op registration."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from engine.host_kernels.build import HostLibrary, library
from engine.host_kernels.build import build_info as _build_info
from engine.host_kernels.build import summary as _summary
from nki_kernels import dispatch

# Largest x row count each native kernel takes, per build ("mhc": the small per-token ops but sparse_attn, which has
# its own; "pool": compress_pool's pooled entries; "index": index_score's decode rows); above it the reference is as
# fast or faster (scripts/bench_host_kernels.py measures the crossover; docs/host_kernels_history.md says why each).
# "close": the blocks one compressor closes in a fused decode call (attn_decode, decode_layer, mtp_pass), pooled in
# it with compress_pool's routine - past it the whole layer runs op by op, so it is not compress_pool's crossover.
# A fused decode call takes the least limit of its kernels' keys, so a limit is also where the fused call stops: on
# avx2 "index" is past index_score's own crossover (a few rows), because there the fused call's selection gains more
# than the op alone loses.
_AVX512_MAX_M = {"linear": 128, "fp8": 128, "fp4": 256, "mhc": 64, "sparse_attn": 64, "pool": 2, "index": 8,
                 "close": 64}
MAX_M = {"avx512-vbmi": dict(_AVX512_MAX_M), "avx512": dict(_AVX512_MAX_M),
         "avx2": {"linear": 128, "fp8": 128, "fp4": 128, "mhc": 128, "sparse_attn": 128, "pool": 2, "index": 128,
                  "close": 128},
         "portable": {"linear": 1, "fp8": 1, "fp4": 4, "mhc": 64, "sparse_attn": 0, "pool": 2, "index": 0,
                      "close": 64}}
EXECUTOR = "host"  # the executor column of the dispatch counters
F32 = torch.float32  # every output buffer the native code writes is allocated with this dtype, never the default
# one (torch.set_default_dtype(torch.bfloat16), as DeepSeek's own inference code sets it, would hand the kernels
# half-sized buffers); as ints, not a torch.Size: torch.empty(*shape, dtype=F32) costs ~1.5 us, (shape, dtype=F32) ~3


def max_m(key: str) -> int:
    """The largest row count the native `key` kernel takes in the build this process runs (MAX_M)."""
    return MAX_M[_native().variant][key]


def max_rows(keys: tuple[str, ...]) -> int:
    """min(max_m(k) for k in keys): the most rows a packed call that runs each of `keys`' kernels takes (a pack's
    `limit_keys`), the build's limits looked up once (not kept: tests change MAX_M)."""
    limits = MAX_M[_native().variant]
    return min(limits[k] for k in keys)


def build_info() -> dict[str, Any]:
    """Which build `--kernels host` runs in this process and why (build.build_info, with the library loaded here)."""
    return _build_info(_lib)


def summary() -> str:
    """One line: the chosen build and every other build's status (build.summary)."""
    return _summary(build_info())



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


def check_rc(rc: int, kernel: str, x: torch.Tensor, bad_id: Exception | None = None) -> None:
    """Raise for a composed native call's return code: -3 (an id out of range) as `bad_id`, any other non-zero
    (-1: out of memory) as a MemoryError naming the kernel and x's shape."""
    if rc == -3 and bad_id is not None:
        raise bad_id
    if rc != 0:
        raise MemoryError(f"host kernel {kernel}: error {rc} for x {list(x.shape)}")


def _f32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype is torch.float32 and t.is_contiguous() else t.float().contiguous()


def _count(key: str) -> None:
    dispatch.current().count(key, EXECUTOR)


def _count_each(keys: tuple[tuple[str, str], ...], times: int = 1) -> None:
    """Count every (key, executor) of `keys` (a pack's: made once) `times` times in the active dispatcher."""
    dispatch.current().count_each(keys, times)



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



def ensure_loaded() -> HostLibrary:
    """Build / load the process's library now (a missing compiler fails here with one line, not at the first
    forward)."""
    return _native()
