"""Building, choosing and loading the native host-kernel library (gemv.c + mhc.c + moe.c + attn.c): one build per
instruction-set variant, and the best one the CPU runs.

    variant       compiler flags (beside BASE_FLAGS)               the CPU must report
    avx512-vbmi   -mavx2 -mfma -mavx512f -mavx512bw -mavx512vbmi   avx avx2 fma avx512f avx512bw avx512vbmi
    avx512        -mavx2 -mfma -mavx512f -mavx512bw                avx avx2 fma avx512f avx512bw
    avx2          -mavx2 -mfma -mf16c                              avx avx2 fma f16c
    portable      none (x86-64 baseline; -march=native elsewhere)  nothing

x86 builds add -mtune=native (scheduling only). The flags name exactly the instruction sets the build may use, so
any build compiles on any x86 machine; which one may *run* is decided three times, and all three must agree:
1. the CPU's flags as the kernel reports them (/proc/cpuinfo; Linux clears AVX-512 there when the OS does not save
   its registers);
2. what `<cc> -march=native` enables (its predefined macros): the compiler's own reading of this CPU;
3. after loading, before any kernel runs, the library's `dk_cpu_missing()` (cpuid through libgcc, compiled for the
   baseline ISA, like the table set-up that runs at load): a build it flags is refused, never called (no SIGILL).
`choose()` takes the first variant, best first, that passes 1 and 2 and is not above the cap DEEPINFER_HOST_SIMD
(auto: no cap). A lower cap emulates an older CPU: on an AVX-512 machine DEEPINFER_HOST_SIMD=avx2 loads the avx2
build, which holds no AVX-512 instruction at all, and reports the AVX-512 builds as not run for that reason.
`load("auto")` steps down past a variant that passed 1 and 2 but fails to compile (an older compiler, a distro's
default flags) or that check 3 refuses (an emulator or VM whose cpuid hides what /proc/cpuinfo shows): that variant
is reported as not run, with the compiler's or the cpuid check's words, and the next one is tried. A variant asked
for by name is never replaced.

Builds are cached in `engine.envs.host_kernel_cache_dir()`, one file per (sources' sha256, compiler, flags, CPU
flags), written atomically (concurrent ranks may build at once); where that directory cannot be written and
DEEPINFER_HOST_KERNEL_CACHE did not name it, in this user's own directory under the temp directory. A missing
compiler, a failed build of the variant asked for (or of every variant, for auto) is a `HostKernelError` (a
ValueError: one line, exit 2 at the CLI), never a silent fallback; so is asking for a build this CPU cannot run (the
message names the missing flags).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import stat
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.host_kernels.abi import layout_mismatch

SOURCES = tuple(Path(__file__).with_name(n) for n in ("gemv.c", "mhc.c", "moe.c", "attn.c", "dk.h",
                                                          "dk_omp.h", "gemv_avx512.h", "gemv_avx2.h"))
COMPILED = tuple(src for src in SOURCES if src.suffix == ".c")  # one library; the headers are hashed, not compiled
NAMES = ", ".join(src.name for src in COMPILED[:-1]) + f" and {COMPILED[-1].name}"  # "gemv.c, ... and attn.c"
# -D_FORTIFY_SOURCE=3: what Ubuntu's gcc sets by default, set everywhere, so a build here is the build there (on a
# Debian machine, without it, a memcpy in a baseline-target function compiled fine and failed on Ubuntu: gcc will
# not inline the fortified always_inline memcpy across target options)
BASE_FLAGS = ("-O3", "-fPIC", "-shared", "-fopenmp", "-D_FORTIFY_SOURCE=3")
LIBS = ("-lm",)  # after the sources (libm's expf / ldexpf / ilogbf: the library loads on its own, not only into Python)
IS_X86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")
_ABI = 3
# CPU feature (its /proc/cpuinfo name) -> the compiler macro that says a build may use it; the bit order is
# gemv.c dk_cpu_missing()'s
FEATURES = {"avx": "__AVX__", "avx2": "__AVX2__", "fma": "__FMA__", "avx512f": "__AVX512F__",
            "avx512bw": "__AVX512BW__", "avx512vbmi": "__AVX512VBMI__", "f16c": "__F16C__"}


class HostKernelError(ValueError):
    """The native host kernels cannot be built or loaded (a user-facing error: one line, exit 2)."""


class CacheNotWritable(HostKernelError):
    """The kernel cache directory cannot be created or written (build_variant then tries the temp directory)."""


class VariantError(HostKernelError):
    """This variant does not compile, or its library's cpuid check refuses this CPU, where a lesser variant may
    still run: `load("auto")` steps down past it. `reason` is the short form for the variant's status."""

    def __init__(self, message: str, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


# gemv.c dk_fp8_decode(): the avx2 build's FP8 decoders (gemv_avx2.h), "only" for the builds with one
FP8_DECODERS = ("only", "shift", "f16c")
_passed_over: dict[tuple[str, str], str] = {}  # (variant, compiler) -> why load("auto") stepped past it here


@dataclass(frozen=True)
class Variant:
    name: str
    flags: tuple[str, ...]  # beside BASE_FLAGS
    needs: tuple[str, ...]  # CPU features (FEATURES keys)
    simd: int  # what gemv.c dk_simd() returns for it


_AVX2 = ("avx", "avx2", "fma")
VARIANTS = {v.name: v for v in (  # best first
    Variant("avx512-vbmi", ("-mavx2", "-mfma", "-mavx512f", "-mavx512bw", "-mavx512vbmi", "-mtune=native"),
            (*_AVX2, "avx512f", "avx512bw", "avx512vbmi"), 2),
    Variant("avx512", ("-mavx2", "-mfma", "-mavx512f", "-mavx512bw", "-mtune=native"), (*_AVX2, "avx512f", "avx512bw"),
            1),
    Variant("avx2", ("-mavx2", "-mfma", "-mf16c", "-mtune=native"), (*_AVX2, "f16c"), 3),
    Variant("portable", ("-mtune=native",) if IS_X86 else ("-march=native",), (), 0),
)}
SIMD_NAMES = {v.simd: v.name for v in VARIANTS.values()}


def cpu_flag_line() -> str:
    """The CPU's feature flags (x86 `flags` / arm64 `Features` of /proc/cpuinfo), part of the build key."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.split(":")[0].strip() in ("flags", "Features"):
                return " ".join(sorted(line.split(":", 1)[1].split()))
    except OSError:
        pass
    return platform.machine() + " " + platform.processor()


@functools.cache
def cpu_features() -> frozenset[str] | None:
    """The FEATURES this CPU reports in /proc/cpuinfo (None: no /proc/cpuinfo flags line to read)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.split(":")[0].strip() == "flags":
            return frozenset(line.split(":", 1)[1].split()) & frozenset(FEATURES)
    return None


@functools.cache
def _predefined_macros(cc: str, *flags: str) -> frozenset[str] | None:
    """The macros `cc <flags>` predefines (None: the compiler is missing or does not answer)."""
    exe = shutil.which(cc)
    if exe is None:
        return None
    try:
        r = subprocess.run([exe, *flags, "-dM", "-E", "-x", "c", os.devnull], capture_output=True, text=True,
                           timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    if r.returncode != 0:
        return None
    return frozenset(ln.split()[1] for ln in r.stdout.splitlines() if ln.startswith("#define "))


def native_features(cc: str) -> frozenset[str] | None:
    """The FEATURES `cc -march=native` enables (None: the compiler is missing or does not answer)."""
    macros = _predefined_macros(cc, "-march=native") if IS_X86 else None
    return None if macros is None else frozenset(f for f, macro in FEATURES.items() if macro in macros)


def is_clang(cc: str) -> bool:
    """Whether `cc` is clang (its predefined __clang__, whatever the executable is called)."""
    return "__clang__" in (_predefined_macros(cc) or ())


def compiler_flags(name: str, cc: str) -> tuple[str, ...]:
    """BASE_FLAGS and variant `name`'s flags for compiler `cc`. clang's -fopenmp takes LLVM's libomp, a second
    OpenMP runtime beside torch's libgomp with its own threads and thread count; so clang gets -fopenmp=libgomp,
    which links torch's runtime but compiles no OpenMP code: its kernels run on one thread (`HostLibrary.parallel`,
    reported by build_info)."""
    omp = "-fopenmp=libgomp" if is_clang(cc) else "-fopenmp"  # clang: no OpenMP code then (dk_parallel() 0)
    return tuple(omp if f == "-fopenmp" else f for f in (*BASE_FLAGS, *VARIANTS[name].flags))


def simd_cap() -> str:
    """DEEPINFER_HOST_SIMD: the most capable variant to use (auto: the best the CPU runs)."""
    from engine.envs import get_envs

    cap = get_envs().DEEPINFER_HOST_SIMD
    if cap != "auto" and cap not in VARIANTS:
        raise HostKernelError(f"DEEPINFER_HOST_SIMD={cap!r}: expected auto or one of {', '.join(VARIANTS)}")
    return cap


def why_not(name: str, cc: str, cap: str = "auto") -> str | None:
    """Why variant `name` may not run here (None: it may): the CPU lacks a feature it uses, `cc -march=native` does
    not enable one, or it is above the cap."""
    v = VARIANTS[name]
    if v.needs and not IS_X86:
        return f"not an x86 CPU ({platform.machine()})"
    cpu = cpu_features()
    if cpu is not None and (lack := [f for f in v.needs if f not in cpu]):
        return f"CPU lacks {', '.join(lack)}"
    native = native_features(cc)
    if native is not None and (lack := [f for f in v.needs if f not in native]):
        return f"{cc} -march=native does not enable {', '.join(lack)}"
    order = list(VARIANTS)
    if cap != "auto" and order.index(name) < order.index(cap):
        return f"above DEEPINFER_HOST_SIMD={cap}"
    return _passed_over.get((name, cc))


def choose(cc: str, cap: str = "auto") -> str:
    """The best variant that may run here (portable always may)."""
    return next(name for name in VARIANTS if why_not(name, cc, cap) is None)


def probe() -> str:
    """The variant `library()` would load, decided without compiling anything (the CPU's flags, the compiler's
    `-march=native` macros and the cap); a HostKernelError where the compiler is missing. A build that then fails
    fails at first use (`library()`), with the compiler's words."""
    from engine.envs import get_envs

    cc = get_envs().DEEPINFER_HOST_CC
    if shutil.which(cc) is None:
        raise HostKernelError(f"--kernels host: C compiler {cc!r} not found (install gcc or set DEEPINFER_HOST_CC)")
    return choose(cc, simd_cap())


def build_key(cc: str, flags: tuple[str, ...]) -> str:
    h = hashlib.sha256()
    for src in SOURCES:
        h.update(src.read_bytes() + b"\0")
    for part in (cc, " ".join((*flags, *LIBS)), cpu_flag_line()):
        h.update(b"\0" + part.encode())
    return h.hexdigest()[:24]


def build(cc: str, flags: tuple[str, ...], cache_dir: Path) -> Path:
    """The compiled library for (sources, cc, flags, CPU): from the cache, else compiled now (compiling needs no
    CPU support: any variant builds on any x86 machine)."""
    out = Path(cache_dir) / f"gemv-{build_key(cc, flags)}.so"
    if out.exists():
        return out
    exe = shutil.which(cc)
    if exe is None:
        raise HostKernelError(f"--kernels host: C compiler {cc!r} not found (install gcc or set DEEPINFER_HOST_CC)")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=out.stem + ".", suffix=".tmp", dir=out.parent)
        os.close(fd)
    except OSError as e:
        raise CacheNotWritable(f"--kernels host: cannot write the kernel cache {out.parent}: {e}") from None
    try:
        r = subprocess.run([exe, *flags, *map(str, COMPILED), *LIBS, "-o", tmp], capture_output=True, text=True,
                           timeout=300)
        if r.returncode != 0:
            lines = [ln for ln in (r.stderr or r.stdout).splitlines() if ln.strip()]
            err = next((ln for ln in lines if "error" in ln), lines[-1] if lines else f"exit {r.returncode}")
            raise VariantError(f"--kernels host: compiling {NAMES} with {cc} failed: {err.strip()}",
                               f"{cc} failed to compile it: {err.strip()}")
        os.replace(tmp, out)  # atomic: a concurrent build of the same key writes the same bytes
    except (OSError, subprocess.SubprocessError) as e:
        raise HostKernelError(f"--kernels host: compiling {NAMES} with {cc} failed: {e}") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def build_variant(name: str, cc: str = "gcc", cache_dir: str | Path | None = None) -> Path:
    """Compile (or find) variant `name`'s library without loading it: in `cache_dir`, else in the engine's cache
    (`host_kernel_cache_dir()`) or, where that cannot be written and DEEPINFER_HOST_KERNEL_CACHE did not name it (a
    container's read-only home), in a directory of this user's under the temp directory."""
    from engine.envs import get_envs, host_kernel_cache_dir

    flags = compiler_flags(name, cc)
    if cache_dir is not None:
        return build(cc, flags, Path(cache_dir))
    try:
        return build(cc, flags, host_kernel_cache_dir())
    except CacheNotWritable as e:
        if get_envs().DEEPINFER_HOST_KERNEL_CACHE:
            raise
        first = e
    return build(cc, flags, _private_temp_cache(first))


def _private_temp_cache(first: CacheNotWritable) -> Path:
    """This user's own directory under the temp directory (mode 700, checked: a library is loaded from it, so a
    directory someone else made there is refused, never used)."""
    d = Path(tempfile.gettempdir()) / f"deepinfer-host-kernels-{os.getuid()}"
    try:
        d.mkdir(mode=0o700, exist_ok=True)
        st = d.lstat()
    except OSError as e:
        raise CacheNotWritable(f"{first}; nor {d}: {e}") from None
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
        raise CacheNotWritable(f"{first}; and {d} is not a directory of this user's alone (not used)")
    return d


class HostLibrary:
    """The loaded kernel library: ctypes functions with their argument types. Loading checks, before any kernel can
    run, that the library is the variant asked for and that this CPU has every instruction set it was built for."""

    def __init__(self, path: Path, variant: str) -> None:
        self.path, self.variant = path, variant
        try:
            lib = ctypes.CDLL(str(path))
        except OSError as e:
            raise HostKernelError(f"--kernels host: cannot load {path}: {e}") from None
        for f in (lib.dk_abi, lib.dk_simd, lib.dk_cpu_missing):
            f.restype = ctypes.c_int
        if lib.dk_abi() != _ABI:
            raise HostKernelError(f"--kernels host: {path} has ABI {lib.dk_abi()}, expected {_ABI}")
        missing = lib.dk_cpu_missing()
        if missing:
            lack = ", ".join(f for i, f in enumerate(FEATURES) if missing >> i & 1)
            raise VariantError(f"--kernels host: build {variant} uses {lack}, which this CPU lacks (the library's "
                               f"own cpuid check)", f"the library's cpuid check: CPU lacks {lack}")
        self.simd = SIMD_NAMES.get(lib.dk_simd(), str(lib.dk_simd()))
        if self.simd != variant:
            raise HostKernelError(f"--kernels host: {path.name} was compiled as {self.simd}, not {variant} (the "
                                  f"compiler ignored {' '.join(VARIANTS[variant].flags)}?)")
        p, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
        lib.dk_bf16_linear.argtypes = [p, p, p, i64, i64, i64, i32]
        lib.dk_fp8_linear.argtypes = [p, p, p, p, i64, i64, i64, i32]
        lib.dk_fp4_linear.argtypes = [p, p, p, p, i64, i64, i64, i32]
        lib.dk_hc_mixes.argtypes = [p, p, p, p, p, p, p, i64, i64, i64, i64, f32, f32, i32]
        lib.dk_rms_norm.argtypes = [p, p, p, i64, i64, f32, i32]
        lib.dk_hc_collapse.argtypes = [p, p, p, i64, i64, i64, i32]
        lib.dk_keep_rows.argtypes = [p, i64, i64, i64, p, p, p, i64, i32, p, p]
        lib.dk_hc_pre.argtypes = [p, p, p, p, p, p, p, p, p, p, i64, i64, i64, i64, f32, f32, i32]
        lib.dk_hc_expand.argtypes = [p, p, p, p, p, i64, i64, i64, i32]
        lib.dk_sparse_attn.argtypes = [p, p, p, p, p, p, i64, i64, i64, i64, i64, i64, f32, i32]
        lib.dk_moe_ffn.argtypes = [p, i64, i64, i64, f32, p, p, i64, i64, i64, i32, p, i32, p, p, i32]
        lib.dk_bf16_grouped_linear.argtypes = [p, p, p, i64, i64, i64, i64, i32]
        lib.dk_rope_tail.argtypes = [p, p, p, p, i64, i64, i64, i64, i32]
        lib.dk_route.argtypes = [p, p, p, p, p, i64, i64, i64, f32]
        lib.dk_hc_head.argtypes = [p, p, p, p, p, i64, i64, i64, f32, f32, i32]
        lib.dk_attn_qkv.argtypes = [p, i64, i64, i32, p, p, p, i64, i32, p, p, i64, i64, i32, p, p, p, p, p, i64, f32,
                                    p, p, p, i32]
        lib.dk_attn_decode.argtypes = [p, i64, i64, i64, p, i64, p, p, p, i64, p, i64, i64, p, p, p, p, p, i64, i64,
                                       i64, i64, p, f32, p, p, i64, p, i64, i64, i32, p, p, i64, p, i64, p, p, p, p, p,
                                       i64, p, p, p, p, p, i64, i64, i32]
        lib.dk_index_score.argtypes = [p, p, p, i64, i64, i64, i64, i64, p]
        lib.dk_attn_front.argtypes = [p, i64, i64, i64, p, p, p, i64, f32, f32, p, i32, p, p, p, i64, i32, p, p, i64,
                                      i64, i32, p, p, p, p, p, i64, f32, i64, p, p, p, p, p, p, p, p, p, p, i32]
        lib.dk_decode_layer.argtypes = [p, p, p, i64, p, p, p, p, p, p, i64, i64, p, p, p, p, p, p, i64, i64, i32]
        lib.dk_compress_pool.argtypes = [p, p, p, p, i64, i64, i64, i64, i32, p]
        lib.dk_mtp_input.argtypes = [p, p, p, i32, i64, p, p, f32, i32, p, p, i32, p, p, p, i64, i64, i64, i32]
        lib.dk_lm_head.argtypes = [p, i64, i64, i64, p, p, p, f32, f32, p, i32, p, p, i64, p, i32]
        lib.dk_mtp_pass.argtypes = [p, p, p, p, p, p, i64, p, p, p, p, p, p, i64, i64, p, p, p, p, i64, p, p, i32]
        lib.dk_mtp_draft.argtypes = [p, p, p, p, p, i64, p, p, i64, i64, p, p, p, i64, i64, i64, p, p, i32]
        lib.dk_layer_layout.argtypes = [p, i64]
        lib.dk_layer_layout.restype = ctypes.c_int64
        lib.dk_ffn_site.argtypes = [p, i64, i64, i64, p, p, p, i64, f32, f32, p, p, i64, p, p, i64, f32, i64, f32, i64,
                                    i64, i32, p, i32, p, p, i32]
        lib.dk_parallel.restype = i32
        lib.dk_attn_heads_per_pass.restype = i32
        lib.dk_pool_slots.restype = i32
        lib.dk_fp8_decode.argtypes = [i32]
        lib.dk_fp8_decode.restype = i32
        lib.dk_subnormal_cost.restype = ctypes.c_double
        for f in (lib.dk_bf16_linear, lib.dk_fp8_linear, lib.dk_fp4_linear, lib.dk_max_threads, lib.dk_last_threads,
                  lib.dk_hc_mixes, lib.dk_rms_norm, lib.dk_hc_collapse, lib.dk_hc_pre, lib.dk_hc_expand,
                  lib.dk_sparse_attn, lib.dk_moe_ffn, lib.dk_bf16_grouped_linear, lib.dk_rope_tail, lib.dk_route,
                  lib.dk_hc_head, lib.dk_attn_qkv, lib.dk_ffn_site, lib.dk_attn_decode, lib.dk_attn_front,
                  lib.dk_decode_layer, lib.dk_compress_pool, lib.dk_index_score, lib.dk_mtp_input,
                  lib.dk_lm_head, lib.dk_mtp_pass, lib.dk_mtp_draft, lib.dk_keep_rows):
            f.restype = i32
        if (why := layout_mismatch(lib)) is not None:
            raise HostKernelError(f"--kernels host: {path.name}: the decode layer's argument struct differs from "
                                  f"engine/host_kernels/abi.py DkLayer ({why})")
        self.lib = lib
        self.fp8_decoder = FP8_DECODERS[lib.dk_fp8_decode(-1)]  # the avx2 build chooses here, before any FP8 call
        self.subnormal_cost = float(lib.dk_subnormal_cost())
        self.parallel = bool(lib.dk_parallel())  # False: every kernel runs on the calling thread (clang)
        self.attn_heads = lib.dk_attn_heads_per_pass()  # sparse_attn's heads per pass: scratch 2 * this * N floats
        self.pool_slots = lib.dk_pool_slots()  # the most slots compress_pool and the closing blocks pool

    def set_fp8_decoder(self, name: str) -> None:
        """Make the avx2 build use FP8 decoder `name` (FP8_DECODERS; for tests: each must be exact here, whichever
        this CPU gets). Not while a kernel runs."""
        if self.variant != "avx2" or name not in FP8_DECODERS[1:]:
            raise ValueError(f"build {self.variant} has no FP8 decoder {name!r}")
        self.fp8_decoder = FP8_DECODERS[self.lib.dk_fp8_decode(FP8_DECODERS.index(name))]

    def fp8_decoder_info(self) -> str | None:
        """The avx2 build's FP8 decoder and why (None: the build has one): results metadata."""
        if self.fp8_decoder == "only":
            return None
        cost = f"an FMA with a subnormal input takes {self.subnormal_cost:.1f}x the time here"
        return f"{self.fp8_decoder} ({cost}; f16c above 4x)" if self.subnormal_cost else self.fp8_decoder

    def max_threads(self) -> int:
        """omp_get_max_threads() as the library sees it (equals torch's count when the runtime is shared)."""
        return int(self.lib.dk_max_threads())

    def last_threads(self) -> int:
        """OpenMP threads the last kernel call ran with."""
        return int(self.lib.dk_last_threads())

    def gemv(self, fmt: str, x: torch.Tensor, w: torch.Tensor, s: torch.Tensor | None, y: torch.Tensor, m: int,
             n: int, k: int) -> None:
        """y [.., N] = x [.., K] @ W^T for M = m rows: all fp32 / uint8 / bf16 contiguous CPU tensors of the checked
        shapes (the callers check: the C side trusts them)."""
        nt = torch.get_num_threads()
        if fmt == "bf16":
            rc = self.lib.dk_bf16_linear(x.data_ptr(), w.data_ptr(), y.data_ptr(), m, n, k, nt)
        elif fmt == "fp8":
            rc = self.lib.dk_fp8_linear(x.data_ptr(), w.data_ptr(), s.data_ptr(), y.data_ptr(), m, n, k, nt)
        else:
            rc = self.lib.dk_fp4_linear(x.data_ptr(), w.data_ptr(), s.data_ptr(), y.data_ptr(), m, n, k, nt)
        if rc != 0:
            raise MemoryError(f"host kernel {fmt}: out of memory for x [{m}, {k}]")


def load(variant: str = "auto", cc: str = "gcc", cache_dir: str | None = None) -> HostLibrary:
    """Variant `variant`'s library (auto: `choose(cc, DEEPINFER_HOST_SIMD)`, stepping down past a variant that does
    not compile or that its cpuid check refuses, which then reports as not run), built or found, checked and loaded
    once per process; a variant that may not run here is refused before it is loaded, with the reason."""
    cap = simd_cap()
    if variant != "auto":
        if variant not in VARIANTS:
            raise HostKernelError(f"--kernels host: no build {variant!r} (builds: {', '.join(VARIANTS)})")
        why = why_not(variant, cc, cap)
        if why is not None:
            raise HostKernelError(f"--kernels host: build {variant} cannot run here: {why}")
        return _load(variant, cc, cache_dir)
    while True:
        name = choose(cc, cap)
        try:
            return _load(name, cc, cache_dir)
        except VariantError as e:
            if name == list(VARIANTS)[-1]:  # the last: nothing left to step down to
                raise
            _passed_over[(name, cc)] = e.reason


@functools.cache
def _load(name: str, cc: str, cache_dir: str | None) -> HostLibrary:
    return HostLibrary(build_variant(name, cc, cache_dir), name)


def library() -> HostLibrary:
    """The process's library: the best build this CPU runs (compiler: DEEPINFER_HOST_CC)."""
    from engine.envs import get_envs

    return load("auto", get_envs().DEEPINFER_HOST_CC)


def build_info(loaded: HostLibrary | None = None) -> dict[str, Any]:
    """Which build `--kernels host` runs here and why, for results metadata: the chosen variant, the cap, the CPU
    features that matter (as /proc/cpuinfo and `cc -march=native` report them), every variant's status ("chosen",
    "can run", "not run: <reason>") and the library loaded in this process, if any. Builds nothing."""
    from engine.envs import get_envs

    cc = get_envs().DEEPINFER_HOST_CC
    try:
        cap = simd_cap()
    except HostKernelError as e:
        return {"error": str(e)}
    chosen = choose(cc, cap)
    status = {}
    for name in VARIANTS:
        why = why_not(name, cc, cap)
        status[name] = "chosen" if name == chosen else "can run" if why is None else f"not run: {why}"
    better = [f"{n} {s}" for n, s in status.items() if list(VARIANTS).index(n) < list(VARIANTS).index(chosen)]
    cpu, native = cpu_features(), native_features(cc)
    return {"chosen": chosen, "why": "the best build this machine runs" + (f" ({'; '.join(better)})" if better else ""),
            "cap": cap, "compiler": cc, "machine": platform.machine(),
            "cpu_features": None if cpu is None else {f: f in cpu for f in FEATURES},
            "native_features": None if native is None else {f: f in native for f in FEATURES},
            "variants": status,
            "loaded": None if loaded is None else {
                "variant": loaded.variant, "library": loaded.path.name,
                **({"fp8_decoder": d} if (d := loaded.fp8_decoder_info()) else {}),
                **({} if loaded.parallel else {"threads": f"one: {cc} compiled it without OpenMP (clang makes OpenMP "
                                                         "code for its own libomp only, not torch's libgomp)"})}}


def summary(info: dict[str, Any] | None = None) -> str:
    """One line for logs and `deepinfer env`: "host kernels: avx2 (avx512-vbmi: not run: CPU lacks ...; ...)"."""
    info = info or build_info()
    if "error" in info:
        return f"host kernels: {info['error']}"
    rest = "; ".join(f"{n}: {s}" for n, s in info["variants"].items() if s != "chosen")
    return f"host kernels: {info['chosen']} ({rest})"
