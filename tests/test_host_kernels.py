"""`--kernels host`: the native kernels (engine/host_kernels) against the torch reference (nki_kernels/reference).

Builds. Every instruction-set variant (avx512-vbmi, avx512, avx2, portable) compiles on any x86 machine; which may
run depends on the CPU. This file works out, on its own and from the CPU's flags (/proc/cpuinfo), which variants
this machine can run and which one the loader must choose (the best), and checks that the loader agrees. Every
variant the CPU can run is checked against the reference by every kernel test below (the `lib` fixture is
parametrized over them); every variant it cannot run is reported as not run, with the reason, by
`test_a_variant_this_cpu_cannot_run_is_built_but_refused` (it must still compile, the loader must refuse it naming
the missing CPU flag, and the library's own cpuid check must refuse it too), which also emits a `NotRunHere` warning
so the reason shows in pytest's summary. DEEPINFER_HOST_SIMD=<variant> caps the choice: with
DEEPINFER_HOST_SIMD=avx2 an AVX-512 machine runs this file (and the whole suite) as an AVX2-only machine would, the
AVX-512 builds reported as not run ("above DEEPINFER_HOST_SIMD=avx2").

Tolerances. Decoding is checked bit for bit: with one-hot x rows every output is one weight element times 1 plus
exact zeros, so it must equal the reference's dequantised element exactly (every code in every lane position,
extreme scales), one x row per call (the M = 1 kernels) and 16 (the tiles). Random x: both sides accumulate in fp32
in different orders; each side's error is at most gamma_K * sum_k |x_k||w_k| (gamma_K ~ K * u, u = 2^-24: the
standard bound of a K-term fp32 dot product), so the check is |native - reference| <= 2 * K * u * sum_k |x_k||w_k|
for every output (plus one bf16 rounding of the result, one bf16 ulp, for bf16 x). The bound cannot flake; typical
errors are ~1e-3 of it.
"""

from __future__ import annotations

import ctypes
import dataclasses
import math
import os
import platform
import re
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from engine import host_kernels as H
from engine.envs import get_envs
from engine.host_kernels import build as B
from nki_kernels import dispatch
from nki_kernels import reference as R

U = 2.0**-24
IS_X86 = platform.machine().lower() in ("x86_64", "amd64")
# Each variant and the CPU flags (/proc/cpuinfo names) it needs, best first: written here independently of
# engine/host_kernels/build.py, whose choice the tests check against it.
NEEDS = {"avx512-vbmi": ("avx", "avx2", "fma", "avx512f", "avx512bw", "avx512vbmi"),
         "avx512": ("avx", "avx2", "fma", "avx512f", "avx512bw"),
         "avx2": ("avx", "avx2", "fma"),
         "portable": ()}


class NotRunHere(UserWarning):
    """A kernel build this CPU cannot run (the reason is the message)."""


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.split(":")[0].strip() == "flags":
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


CPU = _cpu_flags()
CAP = B.simd_cap()


def _why_not_here(variant: str) -> str | None:
    """Why this machine cannot run `variant` (None: it can), from the CPU flags and the DEEPINFER_HOST_SIMD cap."""
    if NEEDS[variant] and not IS_X86:
        return "not an x86 CPU"
    lack = [f for f in NEEDS[variant] if f not in CPU]
    if lack:
        return f"CPU lacks {', '.join(lack)}"
    if CAP != "auto" and list(NEEDS).index(variant) < list(NEEDS).index(CAP):
        return f"above DEEPINFER_HOST_SIMD={CAP}"
    return None


RUNNABLE = [v for v in NEEDS if _why_not_here(v) is None]
NOT_RUNNABLE = [v for v in NEEDS if _why_not_here(v) is not None]
EXPECTED = RUNNABLE[0]  # the best build this machine may run


@pytest.fixture(scope="module")
def cache_dir() -> str:
    """The engine's own build cache (keyed by source hash, compiler, flags and CPU: a rerun compiles nothing)."""
    from engine.envs import host_kernel_cache_dir

    return str(host_kernel_cache_dir())


REAL_MAX_M = {b: dict(lim) for b, lim in H.MAX_M.items()}
WIDEST = {k: max(lim[k] for lim in REAL_MAX_M.values()) for k in REAL_MAX_M["portable"]}


# each build this CPU can run; the avx2 build once per FP8 decoder (a process uses the one its CPU measures
# cheaper: both must be exact on every CPU)
BUILDS = [b for v in RUNNABLE for b in ((f"{v}:shift", f"{v}:f16c") if v == "avx2" else (v,))]


@pytest.fixture(params=BUILDS)
def lib(request: pytest.FixtureRequest, cache_dir: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[H.HostLibrary]:
    """Each build this CPU can run, installed as the process's library for one test, taking every row count up to
    the widest threshold any build uses (WIDEST), so each build's kernels are checked over the same range; the
    build's own thresholds: test_above_the_threshold_the_reference_runs_counted."""
    variant, _, decoder = request.param.partition(":")
    built = H.load(variant, get_envs().DEEPINFER_HOST_CC, cache_dir)
    assert built.variant == built.simd == variant  # dk_simd(): the code paths compiled in are that variant's
    monkeypatch.setattr(H, "_lib", built)
    monkeypatch.setitem(H.MAX_M, variant, dict(WIDEST))
    chosen = built.fp8_decoder
    if decoder:
        built.set_fp8_decoder(decoder)
    yield built
    if decoder:
        built.set_fp8_decoder(chosen)


@pytest.fixture
def widest(monkeypatch: pytest.MonkeyPatch) -> str:
    """The process's own build (whichever the CPU and DEEPINFER_HOST_SIMD give) taking every row count up to WIDEST,
    for the tests that check the native kernels run *inside the model*: their batches (2-4 rows) are above some
    builds' thresholds (portable takes FP8 and bf16 at one row only), and what they check is the native path, not
    the policy (each build's thresholds: test_above_the_threshold_the_reference_runs_counted)."""
    variant = H.ensure_loaded().variant
    monkeypatch.setitem(H.MAX_M, variant, dict(WIDEST))
    return variant


# ---------------------------------------------------------------------------------------------------------------
# Which build runs


def test_the_loader_chooses_the_best_build_this_cpu_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    cc = get_envs().DEEPINFER_HOST_CC
    assert B.choose(cc, CAP) == EXPECTED
    monkeypatch.setattr(H, "_lib", None)
    H.ensure_loaded()
    assert H.library().variant == H.library().simd == EXPECTED
    info = H.build_info()
    assert info["chosen"] == EXPECTED and info["loaded"]["variant"] == EXPECTED and info["cap"] == CAP
    assert list(info["variants"]) == list(NEEDS)
    for v in NEEDS:
        why = _why_not_here(v)
        want = "chosen" if v == EXPECTED else "can run" if why is None else f"not run: {why}"
        assert info["variants"][v] == want
    if IS_X86 and CPU:
        assert info["cpu_features"] == {f: f in CPU for f in B.FEATURES}
    line = H.summary()
    assert line.startswith(f"host kernels: {EXPECTED} (") and all(v in line for v in NEEDS)
    from engine.stack import probe

    assert probe()["host_kernels"]["chosen"] == EXPECTED  # every results meta.json says which build runs


def test_a_cap_on_the_build_emulates_an_older_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """DEEPINFER_HOST_SIMD=<build> (B.simd_cap): the loader takes that build or the best below it, and reports every
    build above it as not run for that reason."""
    cc = get_envs().DEEPINFER_HOST_CC
    for cap in RUNNABLE:
        assert B.choose(cc, cap) == cap
        for v in list(NEEDS)[:list(NEEDS).index(cap)]:
            assert B.why_not(v, cc, cap) in (_why_not_here(v), f"above DEEPINFER_HOST_SIMD={cap}")
    monkeypatch.setattr(B, "simd_cap", lambda: RUNNABLE[-1])
    assert B.load("auto", cc).variant == RUNNABLE[-1]
    if len(RUNNABLE) > 1:
        with pytest.raises(H.HostKernelError, match=f"above DEEPINFER_HOST_SIMD={RUNNABLE[-1]}"):
            B.load(RUNNABLE[0], cc)
        assert H.build_info()["variants"][RUNNABLE[0]] == f"not run: above DEEPINFER_HOST_SIMD={RUNNABLE[-1]}"


@pytest.mark.parametrize("variant", NOT_RUNNABLE or ["(none)"])
def test_a_variant_this_cpu_cannot_run_is_built_but_refused(variant: str, cache_dir: str) -> None:
    """Reported as not run, with the reason: it compiles (gcc builds any x86 variant anywhere), the loader refuses it
    before loading it (naming the missing CPU flag), and so does the library's own cpuid check (run in a child
    process, so a wrong answer there cannot take this one down with SIGILL)."""
    if variant == "(none)":
        assert RUNNABLE == list(NEEDS)  # this CPU runs every build: nothing to report
        return
    why = _why_not_here(variant)
    warnings.warn(NotRunHere(f"host kernel build {variant}: not run: {why}"), stacklevel=1)
    cc = get_envs().DEEPINFER_HOST_CC
    if IS_X86:
        path = B.build_variant(variant, cc, cache_dir)
        assert path.read_bytes()[:4] == b"\x7fELF"
    with pytest.raises(H.HostKernelError, match=f"build {variant} cannot run here: .*{why.split()[-1]}"):
        H.load(variant, cc, cache_dir)
    lack = [f for f in NEEDS[variant] if f not in CPU]
    if IS_X86 and lack:
        code = (f"from pathlib import Path; from engine.host_kernels.build import HostLibrary, HostKernelError\n"
                f"try:\n    HostLibrary(Path({str(path)!r}), {variant!r})\nexcept HostKernelError as e:\n"
                f"    print(e)")
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        assert f"build {variant} uses {', '.join(lack)}, which this CPU lacks" in r.stdout


def test_an_unwritable_cache_falls_back_to_a_private_temp_dir(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A read-only home (a container run as another user): the library builds in this user's own directory under
    the temp directory (mode 700); a directory there that others may write is refused, never loaded from; a cache the
    user named (DEEPINFER_HOST_KERNEL_CACHE) is not replaced: its error stands."""
    cc = get_envs().DEEPINFER_HOST_CC
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    (tmp_path / "tmp").mkdir()
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))  # no directory can be made under a file, not even by root
    monkeypatch.delenv("DEEPINFER_HOST_KERNEL_CACHE", raising=False)
    monkeypatch.setattr(B.tempfile, "tempdir", str(tmp_path / "tmp"))
    get_envs.cache_clear()
    try:
        path = B.build_variant("portable", cc)
        assert path.parent == tmp_path / "tmp" / f"deepinfer-host-kernels-{os.getuid()}" and path.exists()
        assert path.parent.stat().st_mode & 0o777 == 0o700
        path.parent.chmod(0o777)
        with pytest.raises(H.HostKernelError, match="not a directory of this user's alone"):
            B.build_variant("portable", cc)
        monkeypatch.setenv("DEEPINFER_HOST_KERNEL_CACHE", str(blocker / "kernels"))
        get_envs.cache_clear()
        with pytest.raises(H.HostKernelError, match="cannot write the kernel cache"):
            B.build_variant("portable", cc)
    finally:
        monkeypatch.undo()
        get_envs.cache_clear()


class _HidesFeatures:
    """A loaded library whose cpuid check reports AVX missing, as under an emulator whose cpuid hides what the host's
    /proc/cpuinfo shows (qemu-x86_64 -cpu EPYC-Milan on an AVX-512 machine)."""

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._lib = lib

    def __getattr__(self, name: str):
        if name == "dk_cpu_missing":
            def missing() -> int:
                return 1  # bit 0: avx
            return missing
        return getattr(self._lib, name)


@pytest.mark.parametrize("how", ["compile", "cpuid"])
def test_auto_steps_down_past_a_build_that_fails_to_compile_or_that_its_cpuid_check_refuses(
        how: str, cache_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """As where the compiler rejects the best build (Ubuntu's gcc, whose default _FORTIFY_SOURCE once broke every SIMD
    build) or where cpuid hides a feature /proc/cpuinfo shows: `load("auto")` takes the next build, build_info
    reports the skipped one as not run with the compiler's / the cpuid check's words, and a build asked for by name
    is refused, not replaced."""
    cc = get_envs().DEEPINFER_HOST_CC
    first = RUNNABLE[0]
    monkeypatch.setattr(B, "_passed_over", {})
    monkeypatch.setattr(H, "_lib", None)
    B._load.cache_clear()  # the cpuid case needs a fresh load of `first`
    if how == "compile":
        v = B.VARIANTS[first]
        monkeypatch.setitem(B.VARIANTS, first, dataclasses.replace(v, flags=(*v.flags, "-mno-such-option-deepinfer")))
        reason = f"{cc} failed to compile it: "
    else:
        hidden, real = str(B.build_variant(first, cc, cache_dir)), ctypes.CDLL
        monkeypatch.setattr(B.ctypes, "CDLL", lambda path, *a, **k: (
            _HidesFeatures(real(path, *a, **k)) if str(path) == hidden else real(path, *a, **k)))
        reason = "the library's cpuid check: CPU lacks avx"
    try:
        if len(RUNNABLE) == 1:  # portable only: nothing to step down to, the failure is the error
            with pytest.raises(H.HostKernelError):
                B.load("auto", cc, cache_dir)
            return
        lib = B.load("auto", cc, cache_dir)
        assert lib.variant == lib.simd == RUNNABLE[1]
        info = B.build_info(lib)
        assert info["chosen"] == RUNNABLE[1] and info["loaded"]["variant"] == RUNNABLE[1]
        assert info["variants"][first].startswith(f"not run: {reason}")
        assert f"{first} not run: {reason}" in info["why"]  # and so in kernels_why (engine/config.py)
        from deepinfer_bench.bench.environment import env_tables

        monkeypatch.setattr(H, "_lib", None)
        monkeypatch.setattr(B, "_passed_over", {})  # `deepinfer env` in a fresh process: its build table agrees
        titles = [title for title, _ in env_tables()[0]]  # with the library it loads
        assert f"--kernels host builds on this CPU (chosen: {RUNNABLE[1]})" in titles
        with pytest.raises(H.HostKernelError, match=f"build {first} cannot run here: {re.escape(reason)}"):
            B.load(first, cc, cache_dir)
    finally:
        B._load.cache_clear()


def _fp8(n: int, k: int, g: torch.Generator, scales=(118, 125)) -> tuple[torch.Tensor, torch.Tensor]:
    w = torch.randint(0, 256, (n, k), dtype=torch.uint8, generator=g)
    w[(w & 0x7F) == 0x7F] = 0x38  # no NaN code (tested apart)
    s = torch.randint(*scales, (-(-n // 128), -(-k // 128)), dtype=torch.uint8, generator=g)
    return w, s


def _fp4(n: int, k: int, g: torch.Generator, scales=(118, 125)) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g),
            torch.randint(*scales, (n, k // 32), dtype=torch.uint8, generator=g))


def _dense(op: str, *ws: torch.Tensor) -> torch.Tensor:
    """The reference's own dequantised fp32 weight."""
    if op == "linear":
        return ws[0].float()
    n = ws[0].shape[0]
    return (R.fp8_dequant_rows if op == "fp8" else R.fp4_dequant_rows)(*ws, 0, n)


NATIVE = {"linear": H.linear, "fp8": H.fp8_linear, "fp4": H.fp4_linear}
REF = {"linear": R.linear, "fp8": R.fp8_linear, "fp4": R.fp4_linear}
KEY = {"linear": "host.linear", "fp8": "host.fp8", "fp4": "host.fp4"}


def _assert_close(y: torch.Tensor, ref: torch.Tensor, x: torch.Tensor, dense: torch.Tensor) -> None:
    assert y.shape == ref.shape and y.dtype == ref.dtype
    k = x.shape[-1]
    bound = (x.float().abs().reshape(-1, k) @ dense.abs().T).reshape(ref.shape)  # sum_k |x_k||w_k|
    tol = 2 * k * U * bound
    if y.dtype == torch.bfloat16:
        tol = tol + 2.0**-7 * torch.maximum(y.float().abs(), ref.float().abs())  # one bf16 ulp: the two fp32
        # results may straddle a rounding boundary
    err = (y.float() - ref.float()).abs()
    assert bool((err <= tol).all()), f"max err {err.max():.3e}, worst ratio {(err / tol.clamp_min(1e-38)).max():.3f}"


# ---------------------------------------------------------------------------------------------------------------
# Decoding, bit for bit


def _one_hot(k: int, rows: int) -> list[torch.Tensor]:
    """Identity rows of width k, `rows` per tensor (1: the one-row kernels; 16: the tiles)."""
    eye = torch.eye(k)
    return [eye[j0:j0 + rows] for j0 in range(0, k, rows)]


def _one_hot_columns(op: str, ws: tuple[torch.Tensor, ...], k: int, rows: int = 16) -> torch.Tensor:
    """W[:, j] for every j, through the native op with one-hot x rows (`rows` columns per call)."""
    return torch.cat([NATIVE[op](x, *ws).T for x in _one_hot(k, rows)], dim=1)


def _fp4_scale_rows(n: int) -> torch.Tensor:
    """[n, 3] UE8M0 rows: even rows take scales whose block sums the one-row AVX2 kernel scales once (2..252), odd
    rows also 0 and 1 (2^-127, 2^-126: 0.5 * 2^-127 is an fp32 subnormal), which send a row to the per-weight path."""
    even = torch.tensor([2, 127, 200, 252, 3], dtype=torch.uint8)
    odd = torch.tensor([0, 127, 1, 252, 126], dtype=torch.uint8)
    idx = torch.arange(n * 3).view(n, 3) % 5
    return torch.where(torch.arange(n)[:, None] % 2 == 0, even[idx], odd[idx])


@pytest.mark.parametrize("rows", [1, 16])
def test_fp8_every_code_and_extreme_scales_decode_exactly(lib: H.HostLibrary, rows: int) -> None:
    n, k = 130, 300  # neither a multiple of 128 (partial row and column blocks) nor of 64 (a K tail)
    codes = (torch.arange(n)[:, None] * 7 + torch.arange(k)[None, :]) % 256  # every code in every position
    w = codes.to(torch.uint8)
    w[(w & 0x7F) == 0x7F] = 0  # NaN codes: tested apart
    # UE8M0 extremes: 2^-127 (an fp32 subnormal; products with subnormal e4m3 values are subnormal too), 2^-126,
    # 2^-118 and 2^-117 (either side of where the AVX2 one-row kernel stops pre-scaling x: 2^-9 * 2^(b-127) is
    # subnormal below b = 10), 1, 2^119 (448 * 2^119 is the largest finite product)
    s = torch.tensor([[0, 1, 9], [10, 127, 246]], dtype=torch.uint8)
    got = _one_hot_columns("fp8", (w, s), k, rows)
    assert torch.equal(got, R.fp8_dequant_rows(w, s, 0, n))


@pytest.mark.parametrize("rows", [1, 16])
def test_fp4_every_code_and_extreme_scales_decode_exactly(lib: H.HostLibrary, rows: int) -> None:
    n, k = 40, 96  # K = 64 + a 32-element tail
    w = ((torch.arange(n)[:, None] * 13 + torch.arange(k // 2)[None, :]) % 256).to(torch.uint8)
    s = _fp4_scale_rows(n)
    got = _one_hot_columns("fp4", (w, s), k, rows)
    assert torch.equal(got, R.fp4_dequant_rows(w, s, 0, n))


@pytest.mark.parametrize("rows", [1, 2, 3])
def test_fp4_block_sums_scaled_once_are_exact(lib: H.HostLibrary, rows: int) -> None:
    """At up to 3 x rows with every scale in 2..252, the AVX-512 builds read each 128-element chunk as 16 dwords of 8
    nibbles and scale each block's sum once (gemv_avx512.h tile_fp4dw). K = two such chunks and a 96-element tail
    (64 + 32, the scaled-table decode), N odd (a last weight row on its own). Every code at every position through
    one-hot x rows gives the reference's dequantised weight bit for bit; random x stays within the summation-order
    bound."""
    n, k = 41, 352
    w = ((torch.arange(n)[:, None] * 13 + torch.arange(k // 2)[None, :]) % 256).to(torch.uint8)
    s = (2 + (torch.arange(n * (k // 32)) * 37) % 251).to(torch.uint8).view(n, k // 32)  # 2..252, every block its own
    assert torch.equal(_one_hot_columns("fp4", (w, s), k, rows), R.fp4_dequant_rows(w, s, 0, n))
    s = (110 + (torch.arange(n * (k // 32)) * 37) % 31).to(torch.uint8).view(n, k // 32)  # sums stay finite
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    _assert_close(H.fp4_linear(x, w, s), R.fp4_linear(x, w, s), x, _dense("fp4", w, s))


@pytest.mark.parametrize("rows", [1, 16])
def test_scales_whose_products_overflow_give_what_the_reference_gives(lib: H.HostLibrary, rows: int) -> None:
    """FP8 scales 2^120..2^127 (b 247..254) and FP4 ones 2^126, 2^127 (b 253, 254) take the larger codes to inf;
    through the linear the reference then gives inf, and NaN where a zero x meets an inf weight: the native kernels
    must give the same, value for value (the AVX2 FP8 kernel scales these blocks in two exact steps)."""
    n, k = 200, 256
    codes = (torch.arange(n)[:, None] * 7 + torch.arange(k)[None, :]) % 256
    w = codes.to(torch.uint8)
    w[(w & 0x7F) == 0x7F] = 0
    s = torch.tensor([[247, 120], [254, 250]], dtype=torch.uint8)
    for x in _one_hot(k, rows):
        torch.testing.assert_close(H.fp8_linear(x, w, s), R.fp8_linear(x, w, s), rtol=0, atol=0, equal_nan=True)
    p = ((torch.arange(64)[:, None] * 13 + torch.arange(k // 2)[None, :]) % 256).to(torch.uint8)
    s4 = torch.tensor([253, 254, 127, 252], dtype=torch.uint8)[torch.arange(64 * 8) % 4].view(64, 8)
    for x in _one_hot(k, rows):
        torch.testing.assert_close(H.fp4_linear(x, p, s4), R.fp4_linear(x, p, s4), rtol=0, atol=0, equal_nan=True)


def test_fp8_one_row_gives_the_same_numbers_with_x_prescaled_or_not(lib: H.HostLibrary) -> None:
    """At one x row the AVX-512 and AVX2 FP8 kernels fold each block's scale into a copy of x where that is exact
    (x * 2^(b-127) times the code's value: the reference's products x * w) and otherwise multiply each decoded
    weight vector by it. Both paths must give the same numbers, bit for bit: here one x meets all blocks on the
    pre-scaled path, and the same x with one huge entry (2^126, against an all-zero weight column, so it adds
    exact zeros) sends every block to the other path (with every scale 2^2..2^7, x * 2^(b-127) would overflow)."""
    g = torch.Generator().manual_seed(21)
    n, k = 300, 640  # three 128-row scale blocks (the last partial), five 128-column ones
    w, s = _fp8(n, k, g, scales=(129, 135))
    w[:, 77] = 0
    x = torch.randn(1, k, generator=g)
    x[0, 77] = 0.0
    big = x.clone()
    big[0, 77] = 2.0**126
    y, y_big = H.fp8_linear(x, w, s), H.fp8_linear(big, w, s)
    assert torch.equal(y, y_big)
    _assert_close(y, R.fp8_linear(x, w, s), x, _dense("fp8", w, s))


def test_fp8_subnormal_codes_decode_with_denormals_flushed(lib: H.HostLibrary) -> None:
    """torch.set_flush_denormal(True) sets MXCSR's DAZ / FTZ; subnormal e4m3 codes (m * 2^-9, normal in fp32) must
    still decode to their values (a decoder that passed them through fp32 subnormals would read them as zero)."""
    w = torch.arange(256, dtype=torch.uint8).view(2, 128)
    w[(w & 0x7F) == 0x7F] = 0
    s = torch.tensor([[127]], dtype=torch.uint8)
    if not torch.set_flush_denormal(True):
        pytest.fail("this CPU has no flush-denormal mode to test against")  # every x86 CPU with SSE3 has one
    try:
        for rows in (1, 16):
            assert torch.equal(_one_hot_columns("fp8", (w, s), 128, rows), R.fp8_dequant_rows(w, s, 0, 2))
    finally:
        torch.set_flush_denormal(False)


def test_the_avx2_build_chooses_its_fp8_decoder_by_what_a_subnormal_fma_costs(
        cache_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The avx2 build measures, when it loads, what an FMA with a subnormal input costs (Intel cores: a microcode
    assist) and takes the F16C decoder above 4x, the shift decoder otherwise; results metadata and `deepinfer env`
    say which and why. The other builds have one FP8 decoder and nothing to choose."""
    cc = get_envs().DEEPINFER_HOST_CC
    for variant in RUNNABLE:
        built = H.load(variant, cc, cache_dir)
        if variant != "avx2":
            assert (built.fp8_decoder, built.subnormal_cost, built.fp8_decoder_info()) == ("only", 0.0, None)
            with pytest.raises(ValueError, match=f"build {variant} has no FP8 decoder 'f16c'"):
                built.set_fp8_decoder("f16c")
            continue
        assert built.subnormal_cost > 0
        assert built.fp8_decoder == ("f16c" if built.subnormal_cost > 4 else "shift")
        info = B.build_info(built)["loaded"]["fp8_decoder"]
        assert info.startswith(f"{built.fp8_decoder} (an FMA with a subnormal input takes ")
        from deepinfer_bench.bench.environment import env_tables

        monkeypatch.setattr(B, "simd_cap", lambda: "avx2")
        monkeypatch.setattr(H, "_lib", None)
        builds = next(t for title, t in env_tables()[0] if title.startswith("--kernels host builds"))
        assert builds.set_index("build")["status"]["avx2"] == f"chosen; FP8 decoder {info}"


def test_clang_builds_against_torchs_openmp_runtime_and_says_its_kernels_run_on_one_thread(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """clang's -fopenmp would link LLVM's libomp, a second OpenMP runtime beside torch's libgomp; it gets
    -fopenmp=libgomp, which links torch's runtime and compiles no OpenMP code, and results metadata says the kernels
    then run on one thread (the kernel tests pass under DEEPINFER_HOST_CC=clang: README)."""
    cc = get_envs().DEEPINFER_HOST_CC
    built = H.load(RUNNABLE[-1], cc)
    assert built.parallel != B.is_clang(cc)  # gcc: OpenMP compiled in
    assert ("threads" in B.build_info(built)["loaded"]) == B.is_clang(cc)
    monkeypatch.setattr(B, "is_clang", lambda cc: cc == "clang")
    assert "-fopenmp" in B.compiler_flags("avx2", "gcc") and "-fopenmp=libgomp" not in B.compiler_flags("avx2", "gcc")
    assert "-fopenmp=libgomp" in B.compiler_flags("avx2", "clang") and "-fopenmp" not in B.compiler_flags("avx2",
                                                                                                          "clang")
    monkeypatch.setattr(built, "parallel", False)
    assert B.build_info(built)["loaded"]["threads"].startswith("one: ")


def test_bf16_weight_decodes_exactly(lib: H.HostLibrary) -> None:
    n, k = 33, 100
    bits = torch.randint(0, 1 << 16, (n, k), dtype=torch.int32, generator=torch.Generator().manual_seed(3))
    bits[(bits & 0x7F80) == 0x7F80] = 0x3F80  # no inf / NaN
    w = bits.to(torch.int16).view(torch.bfloat16)
    for rows in (1, 16):
        assert torch.equal(_one_hot_columns("linear", (w,), k, rows), w.float())


def test_nan_codes_and_nan_scales_give_nan_where_the_reference_does(lib: H.HostLibrary) -> None:
    g = torch.Generator().manual_seed(5)
    w, s = _fp8(200, 256, g)
    w[3, 17], w[150, 200] = 0x7F, 0xFF  # NaN codes
    s[0, 1] = 255  # a NaN block scale: rows 0..127
    p, s4 = _fp4(64, 128, g)
    s4[5, 2] = 255
    for m in (1, 2, 5):
        x = torch.randn(m, 256, generator=g)
        y, ref = H.fp8_linear(x, w, s), R.fp8_linear(x, w, s)
        assert torch.equal(y.isnan(), ref.isnan()) and bool(y.isnan().any())
        x = torch.randn(m, 128, generator=g)
        y, ref = H.fp4_linear(x, p, s4), R.fp4_linear(x, p, s4)
        assert torch.equal(y.isnan(), ref.isnan()) and bool(y.isnan().any())


# ---------------------------------------------------------------------------------------------------------------
# Random operands against the reference functions


CASES = [  # (op, N, K)
    ("fp8", 300, 1000), ("fp8", 129, 200), ("fp8", 256, 1024), ("fp8", 77, 96),
    ("fp4", 300, 1024), ("fp4", 77, 96), ("fp4", 5, 32),
    ("linear", 300, 1000), ("linear", 129, 200), ("linear", 64, 1024),
]


def _weights(op: str, n: int, k: int, g: torch.Generator) -> tuple[torch.Tensor, ...]:
    if op == "fp8":
        return _fp8(n, k, g)
    if op == "fp4":
        return _fp4(n, k, g)
    return (torch.randn(n, k, generator=g).bfloat16(),)


@pytest.mark.parametrize("op,n,k", CASES)
def test_matches_reference_at_decode_sizes(lib: H.HostLibrary, op: str, n: int, k: int) -> None:
    g = torch.Generator().manual_seed(n * k)
    ws = _weights(op, n, k, g)
    dense = _dense(op, *ws)
    for lead in ((1,), (2,), (3,), (16,), (2, 3, 2)):  # 1 and 2 rows: the tiles with a tail pass of their own
        for dtype in (torch.float32, torch.bfloat16):
            if op == "linear" and dtype == torch.bfloat16:
                continue  # bf16 x with a bf16 weight is the same-dtype (BLAS) case
            x = torch.randn(*lead, k, generator=g).to(dtype)
            dispatch.reset_counts()
            y = NATIVE[op](x, *ws)
            _assert_close(y, REF[op](x, *ws), x, dense)
            assert dispatch.counts() == {(KEY[op], "host"): 1}


@pytest.mark.parametrize("m", [1, 3])
def test_x_across_the_fp32_exponent_range_matches_reference(lib: H.HostLibrary, m: int) -> None:
    """x entries from 2^-100 to 2^90: x * 2^(b-7) leaves the fp32 range, so the AVX2 FP8 kernel cannot pre-scale x
    for these blocks and multiplies the weights instead; every kernel stays within the summation-order bound."""
    g = torch.Generator().manual_seed(15)
    x = torch.randn(m, 512, generator=g) * 2.0 ** torch.randint(-100, 90, (m, 512), generator=g).float()
    for op, ws in (("fp8", _fp8(300, 512, g)), ("fp4", _fp4(100, 512, g)), ("linear", _weights("linear", 70, 512, g))):
        _assert_close(NATIVE[op](x, *ws), REF[op](x, *ws), x, _dense(op, *ws))


@pytest.mark.parametrize("op", ["fp8", "fp4", "linear"])
def test_every_build_is_exact_up_to_the_widest_row_threshold(lib: H.HostLibrary, op: str) -> None:
    """M = the largest row count any build takes natively (the AVX-512 thresholds), K with a tail."""
    g = torch.Generator().manual_seed(17)
    ws = _weights(op, 96, 224, g)
    x = torch.randn(WIDEST[op], 224, generator=g)
    dispatch.reset_counts()
    _assert_close(NATIVE[op](x, *ws), REF[op](x, *ws), x, _dense(op, *ws))
    assert dispatch.counts() == {(KEY[op], "host"): 1}


@pytest.mark.parametrize("op", ["fp8", "fp4", "linear"])
def test_above_the_threshold_the_reference_runs_counted(lib: H.HostLibrary, op: str,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The build's own row thresholds (MAX_M[build]): native up to it, the reference itself above."""
    monkeypatch.setitem(H.MAX_M, lib.variant, dict(REAL_MAX_M[lib.variant]))
    g = torch.Generator().manual_seed(11)
    ws = _weights(op, 96, 64, g)
    m = H.max_m(op)
    assert m == REAL_MAX_M[lib.variant][op]
    for rows, native in ((m, True), (m + 1, False)):
        x = torch.randn(rows, 64, generator=g)
        dispatch.reset_counts()
        y = NATIVE[op](x, *ws)
        _assert_close(y, REF[op](x, *ws), x, _dense(op, *ws))
        if native:
            assert dispatch.counts() == {(KEY[op], "host"): 1}
        else:
            assert dispatch.counts() == {(f"{KEY[op]}.fallback", "reference"): 1}
            assert dispatch.fallbacks() == {(KEY[op], f"M > {m}"): 1}
            assert torch.equal(y, REF[op](x, *ws))  # the reference itself


def test_other_cases_run_the_reference_with_a_reason(lib: H.HostLibrary) -> None:
    g = torch.Generator().manual_seed(2)
    w = torch.randn(40, 64, generator=g)
    x = torch.randn(2, 64, generator=g)
    dispatch.reset_counts()
    assert torch.equal(H.linear(x, w), R.linear(x, w))  # fp32 weight, fp32 x: BLAS reads it as it is
    assert torch.equal(H.linear(x.bfloat16(), w.bfloat16()), R.linear(x.bfloat16(), w.bfloat16()))
    assert torch.equal(H.linear(x.bfloat16(), w), R.linear(x.bfloat16(), w))  # the reference rounds w to bf16
    w8, s8 = _fp8(40, 64, g)
    assert torch.equal(H.fp8_linear(x.double(), w8, s8), R.fp8_linear(x.double(), w8, s8))
    assert H.fp8_linear(x[:0], w8, s8).shape == (0, 40)
    assert dispatch.fallbacks() == {("host.linear", "same dtype"): 2, ("host.linear", "dtype"): 1,
                                    ("host.fp8", "dtype"): 1, ("host.fp8", "empty"): 1}


def test_non_contiguous_inputs_and_stacked_expert_views(lib: H.HostLibrary) -> None:
    g = torch.Generator().manual_seed(4)
    stack = torch.stack([_fp4(64, 128, g)[0] for _ in range(3)])  # [E, N, K/2] like MoE.stack_w1
    scales = torch.randint(118, 125, (3, 64, 4), dtype=torch.uint8, generator=g)
    x = torch.randn(8, 256, generator=g)[:, ::2]  # non-contiguous [8, 128]
    for e in range(3):
        _assert_close(H.fp4_linear(x, stack[e], scales[e]), R.fp4_linear(x, stack[e], scales[e]), x,
                      _dense("fp4", stack[e], scales[e]))


def test_bad_shapes_raise_the_reference_errors(lib: H.HostLibrary) -> None:
    g = torch.Generator().manual_seed(6)
    w8, s8 = _fp8(130, 200, g)
    with pytest.raises(ValueError, match="does not block w"):
        H.fp8_linear(torch.randn(1, 200), w8, s8[:1])
    with pytest.raises(ValueError, match="does not end in K=200"):
        H.fp8_linear(torch.randn(1, 199), w8, s8)
    p, s4 = _fp4(8, 64, g)
    with pytest.raises(ValueError, match="multiple of 32"):
        H.fp4_linear(torch.randn(1, 64), p, s4[:, :1])
    with pytest.raises(ValueError, match="does not end in K=64"):
        H.fp4_linear(torch.randn(1, 32), p, s4)
    with pytest.raises(RuntimeError):  # F.linear's own shape error, as the reference raises it
        H.linear(torch.randn(1, 7), torch.randn(4, 8).bfloat16())


# ---------------------------------------------------------------------------------------------------------------
# Threads, custom ops, build errors


def test_thread_count_follows_torch_and_does_not_change_results(lib: H.HostLibrary) -> None:
    g = torch.Generator().manual_seed(8)
    w, s = _fp8(1024, 512, g)
    x = torch.randn(4, 512, generator=g)
    before = torch.get_num_threads()
    try:
        out = {}
        for t in (1, 2):
            torch.set_num_threads(t)
            assert lib.max_threads() == t  # the library shares torch's OpenMP runtime (one libgomp.so.1)
            out[t] = H.fp8_linear(x, w, s)
            assert lib.last_threads() == (t if lib.parallel else 1)  # clang: no OpenMP code (build.compiler_flags)
        assert torch.equal(out[1], out[2])  # each output is one thread's fixed-order sum
        _assert_close(out[2], R.fp8_linear(x, w, s), x, _dense("fp8", w, s))
    finally:
        torch.set_num_threads(before)


def test_every_parallel_kernel_gives_one_threads_bits_on_two(lib: H.HostLibrary) -> None:
    """The kernels with a parallel region (gemv.c's GEMVs at one row and at a few; mhc.c's mHC ops, rms_norm and
    sparse_attn) run it on two threads above their size thresholds, and below them - or on one thread - on the
    calling thread outside any region (dk_omp.h DK_PARALLEL): the same bits either way."""
    g = torch.Generator().manual_seed(21)
    x, fn, scale, base = _mhc_inputs(64, 4, 512, g)  # above every mHC op's threshold
    w, post, comb = torch.randn(512, generator=g), torch.rand(64, 4, generator=g), torch.rand(64, 4, 4, generator=g)
    wide = torch.randn(256, 512, generator=g)
    q, kv = torch.randn(8, 1, 8, 128, generator=g), torch.randn(8, 64, 128, generator=g)
    valid, sink = torch.rand(8, 1, 64, generator=g) < 0.7, torch.randn(8, generator=g)
    w8, s8 = _fp8(1024, 512, g)
    p4, s4 = _fp4(1024, 512, g)
    wb = torch.randn(1024, 512, generator=g).bfloat16()
    rows = torch.randn(3, 512, generator=g)

    def every() -> list[torch.Tensor]:
        out = [*H.hc_mixes(x, fn, scale, base, 4, 20, 1e-6, 1e-6), H.rms_norm(wide, w, 1e-6),
               H.hc_collapse(x, post), H.hc_expand(x[:, 0], x, post, comb),
               H.sparse_attn(q, kv, valid, sink, 0.125), H.hc_mixes(x[:1], fn, scale, base, 4, 20, 1e-6, 1e-6)[0]]
        for m in (1, 2, 3):  # run1_fp8 / runm_fp8, and the generic items (FP4 and bf16)
            out += [H.fp8_linear(rows[:m], w8, s8), H.fp4_linear(rows[:m], p4, s4), H.linear(rows[:m], wb)]
        return out

    before = torch.get_num_threads()
    try:
        got = {}
        for t in (1, 2):
            torch.set_num_threads(t)
            got[t] = every()
            assert lib.last_threads() == (t if lib.parallel else 1)
            H.fp8_linear(rows[:1, :128], w8[:8, :128], s8[:1, :1])  # below the GEMV threshold: no region
            assert lib.last_threads() == 1
        assert all(torch.equal(a, b) for a, b in zip(got[1], got[2], strict=True))
    finally:
        torch.set_num_threads(before)


def test_custom_ops_trace_without_graph_breaks(lib: H.HostLibrary) -> None:
    g = torch.Generator().manual_seed(9)
    w8, s8 = _fp8(64, 128, g)
    p, s4 = _fp4(64, 128, g)
    wb = torch.randn(64, 128, generator=g).bfloat16()
    x = torch.randn(2, 128, generator=g)

    def f(x: torch.Tensor) -> torch.Tensor:
        return H.fp8_linear(x, w8, s8) + H.fp4_linear(x, p, s4) + H.linear(x, wb)

    torch._dynamo.reset()
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)  # fullgraph: a graph break is an error
    dispatch.reset_counts()
    y = compiled(x)
    assert torch.equal(y, f(x))
    counts = dispatch.counts()
    assert counts[("host.fp8", "host")] == 2 and counts[("host.fp4", "host")] == 2  # the graph called the ops
    for op, args in ((torch.ops.deepinfer.host_fp8_linear, (x, w8, s8)),
                     (torch.ops.deepinfer.host_fp4_linear, (x, p, s4)),
                     (torch.ops.deepinfer.host_linear, (x, wb))):
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))


def test_small_op_custom_ops_trace_without_graph_breaks(lib: H.HostLibrary) -> None:
    g = torch.Generator().manual_seed(13)
    x, fn, scale, base = _mhc_inputs(2, 4, 64, g)
    w = torch.randn(64, generator=g)
    valid = torch.rand(2, 1, 4, generator=g) < 0.7

    def f(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pre, post, comb = H.hc_mixes(x, fn, scale, base, 4, 20, 1e-6, 1e-6)
        h = H.rms_norm(H.hc_collapse(x, pre), w, 1e-6)
        return H.hc_expand(h, x, post, comb), H.sparse_attn(x[:, None], x, valid, base[:4], 0.125)

    torch._dynamo.reset()
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    dispatch.reset_counts()
    got = compiled(x)
    assert all(torch.equal(a, b) for a, b in zip(got, f(x), strict=True))
    counts = dispatch.counts()
    for key in ("hc_mixes", "rms_norm", "hc_collapse", "hc_expand", "sparse_attn"):
        assert counts[(f"host.{key}", "host")] == 2, key  # once in the graph, once eagerly
    comb = torch.rand(2, 4, 4, generator=g)
    for op, args in ((torch.ops.deepinfer.host_hc_mixes, (x, fn, scale, base, 4, 20, 1e-6, 1e-6)),
                     (torch.ops.deepinfer.host_rms_norm, (x, w, 1e-6)),
                     (torch.ops.deepinfer.host_rms_norm, (x, None, 1e-6)),
                     (torch.ops.deepinfer.host_hc_collapse, (x, comb[:, 0])),
                     (torch.ops.deepinfer.host_hc_expand, (x[:, 0], x, comb[:, 0], comb)),
                     (torch.ops.deepinfer.host_sparse_attn, (x[:, None], x, valid, base[:4], 0.125))):
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("cc,expect", [("no-such-cc-deepinfer", "C compiler 'no-such-cc-deepinfer' not found"),
                                       ("false", "compiling gemv.c, mhc.c, moe.c and attn.c with false failed")])
def test_a_missing_or_failing_compiler_is_one_clear_error(cc: str, expect: str, tmp_path,
                                                          monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture) -> None:
    from deepinfer_bench.cli import main
    from engine.model.ops import ops_for

    monkeypatch.setenv("DEEPINFER_HOST_CC", cc)
    monkeypatch.setenv("DEEPINFER_HOST_KERNEL_CACHE", str(tmp_path))
    get_envs.cache_clear()
    monkeypatch.setattr(H, "_lib", None)
    try:
        with pytest.raises(H.HostKernelError, match=expect):
            ops_for("host")
        monkeypatch.setattr(sys, "argv", ["deepinfer", "golden", "--kernels", "host", "--out", str(tmp_path)])
        with pytest.raises(SystemExit) as ex:
            main()
        assert ex.value.code == 2
        err = capsys.readouterr().err
        assert expect in err.replace("\n", " ") and "Traceback" not in err
        assert not list(tmp_path.glob("*.so")) and not list(tmp_path.glob("*.tmp"))
    finally:
        monkeypatch.undo()
        get_envs.cache_clear()


def test_kernels_host_needs_the_host_backend() -> None:
    """The backend says which op tables it runs (engine/backends): xla refuses the native CPU kernels."""
    from deepinfer_bench.bench.golden import GOLDEN_DIR
    from engine.backends import get_backend
    from engine.config import EngineConfig, ModelConfig

    config = EngineConfig.from_model_config(ModelConfig.from_json(GOLDEN_DIR / "tiny"), kernels="host", backend="xla")
    with pytest.raises(ValueError, match="--kernels host does not run on --backend xla.*native CPU kernels"):
        get_backend(config)


def test_golden_with_host_kernels_matches(widest: str) -> None:
    """`deepinfer golden --kernels host`: every prompt matches with the decode GEMMs and the small per-token ops on
    the native kernels (~10 s)."""
    from deepinfer_bench.bench.golden import GOLDEN_DIR, golden_config, run_golden

    run = run_golden(golden_config(kernels="host"), GOLDEN_DIR)
    assert run.ok, run.table.to_string()
    assert (run.table["tokens_matched"] == run.table["tokens_total"]).all()
    counts = {(k, ex): n for k, ex, n in zip(run.kernels["dispatch_key"], run.kernels["executor"], run.kernels["calls"],
                                              strict=True)}  # the engine's own dispatcher counted them
    for key in ("fp8", "fp4", "linear", "hc_mixes", "rms_norm", "hc_collapse", "hc_expand", "sparse_attn", "moe_ffn"):
        assert counts.get((f"host.{key}", "host"), 0) > 0, key  # ran natively inside the model
    keys = set(run.kernels["dispatch_key"])
    assert {"host.fp8", "host.fp4", "host.linear"} <= keys


def test_the_native_outputs_ignore_torch_default_dtype() -> None:
    """DeepSeek's own inference code runs under torch.set_default_dtype(torch.bfloat16). The native kernels write
    fp32, so every buffer they write is allocated as fp32 explicitly: allocated in the default dtype, the buffers
    were half the size and the heap got corrupted ("corrupted double-linked list", the process killed). The golden
    on the host kernels under a bf16 default, in a child process (a corrupted heap fails this test, not the run)."""
    code = ("import torch\n"
            "from deepinfer_bench.bench.golden import GOLDEN_DIR, golden_config, run_golden\n"
            "torch.set_default_dtype(torch.bfloat16)\n"
            "run = run_golden(golden_config(kernels='host'), GOLDEN_DIR)\n"
            "print('golden', int(run.table['verdict'].eq('match').sum()), len(run.table), run.ok)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900,
                       cwd=Path(__file__).resolve().parents[1])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "golden 12 12 True" in r.stdout, r.stdout[-2000:]


# ---------------------------------------------------------------------------------------------------------------
# The small per-token ops (mhc.c). Error bounds as above: fp32 sums of L terms in different orders differ by at most
# 2 * L * u * (sum of |terms|) per output, plus a few roundings of the result (libm's expf / sqrtf vs torch's
# vectorised ones are within 1-2 ulp).

SMALL_SHAPES = [(1, 4, 128), (3, 4, 1024), (16, 4, 4096), (2, 2, 100)]  # (T, n, D): decode rows, odd sizes


def _mhc_inputs(t: int, n: int, d: int, g: torch.Generator) -> tuple[torch.Tensor, ...]:
    x = torch.randn(t, n, d, generator=g)
    fn = torch.randn((2 + n) * n, n * d, generator=g) / (n * d) ** 0.5
    scale = torch.rand(3, generator=g) + 0.5  # [0.5, 1.5)
    base = torch.randn((2 + n) * n, generator=g)
    return x, fn, scale, base


def _hc_mixes_f64(x, fn, scale, base, n, iters, hc_eps, norm_eps):
    """The formula of reference.hc_mixes (deepseek_v4.md, mHC) in float64: the yardstick for both fp32 sides."""
    v, fn, scale, base = x.flatten(-2).double(), fn.double(), scale.double(), base.double()
    mix = (v @ fn.T) * torch.rsqrt(v.square().mean(-1, keepdim=True) + norm_eps)
    pre = torch.sigmoid(scale[0] * mix[:, :n] + base[:n]) + hc_eps
    post = 2 * torch.sigmoid(scale[1] * mix[:, n:2 * n] + base[n:2 * n])
    c = (scale[2] * mix[:, 2 * n:] + base[2 * n:]).view(-1, n, n).softmax(-1) + hc_eps
    c = c / (c.sum(-2, keepdim=True) + hc_eps)
    for _ in range(iters - 1):
        c = c / (c.sum(-1, keepdim=True) + hc_eps)
        c = c / (c.sum(-2, keepdim=True) + hc_eps)
    return pre, post, c


@pytest.mark.parametrize("t,n,d", SMALL_SHAPES)
def test_hc_mixes_matches_reference(lib: H.HostLibrary, t: int, n: int, d: int) -> None:
    g = torch.Generator().manual_seed(t * 1000 + d)
    x, fn, scale, base = _mhc_inputs(t, n, d, g)
    for dtype in (torch.float32, torch.bfloat16):
        xd = x.to(dtype)
        dispatch.reset_counts()
        got = H.hc_mixes(xd, fn, scale, base, n, 20, 1e-6, 1e-6)
        assert dispatch.counts() == {("host.hc_mixes", "host"): 1}
        ref = R.hc_mixes(xd, fn, scale, base, n, 20, 1e-6, 1e-6)
        exact = _hc_mixes_f64(xd, fn, scale, base, n, 20, 1e-6, 1e-6)
        # Both fp32 sides are measured against float64: the native one may be off by twice the reference's own
        # error plus 2e-6 (outputs lie in [0, 2]; fp32 reordering of the K = n*D-term dots moves them by ~1e-7..1e-6
        # here, measured over 20 seeds per shape: native <= 8.4e-7, at most 3.7x the reference's error). A wrong
        # formula, eps, iteration count or stream order moves them by >= 1e-3.
        ref_err = max(float((a.double() - b).abs().max()) for a, b in zip(ref, exact, strict=True))
        for a, b, e in zip(got, ref, exact, strict=True):
            assert a.shape == b.shape and a.dtype == b.dtype == torch.float32
            err = float((a.double() - e).abs().max())
            assert err <= 2 * ref_err + 2e-6, f"max err {err:.3e} vs the reference's {ref_err:.3e}"
        assert torch.allclose(got[2].sum(-2), torch.ones(t, n), atol=1e-4)  # doubly stochastic (columns last)


@pytest.mark.parametrize("t,d", [(7, 70), (9, 256)])
def test_hc_mixes_of_a_token_do_not_depend_on_the_tokens_beside_it(lib: H.HostLibrary, t: int, d: int) -> None:
    """The native mixes of t tokens at once (token tiles of up to 4, mhc.c `mixes_tile`) are bit for bit each token's
    mixes alone (K = 4 * 70 leaves a tail of 8 after the 16-lane loop)."""
    g = torch.Generator().manual_seed(t + d)
    x, fn, scale, base = _mhc_inputs(t, 4, d, g)
    together = H.hc_mixes(x, fn, scale, base, 4, 20, 1e-6, 1e-6)
    for i in range(t):
        alone = H.hc_mixes(x[i:i + 1].clone(), fn, scale, base, 4, 20, 1e-6, 1e-6)
        for a, b in zip(together, alone, strict=True):
            assert torch.equal(a[i:i + 1], b), f"token {i} of {t}"


@pytest.mark.parametrize("t,n,d", SMALL_SHAPES)
def test_hc_pre_is_the_three_ops_in_a_row(lib: H.HostLibrary, t: int, n: int, d: int) -> None:
    """`hc_pre` (the front of an mHC site) gives exactly what hc_mixes, hc_collapse and rms_norm give one by one in
    the host table, counted under those three keys; a bf16 x takes the one-by-one path (same result, same counts)."""
    g = torch.Generator().manual_seed(t * 31 + d)
    x, fn, scale, base = _mhc_inputs(t, n, d, g)
    w = torch.randn(d, generator=g)
    for dtype in (torch.float32, torch.bfloat16):
        xd = x.to(dtype)
        dispatch.reset_counts()
        pre, post, comb = H.hc_mixes(xd, fn, scale, base, n, 20, 1e-6, 1e-6)
        want = (H.rms_norm(H.hc_collapse(xd, pre), w, 1e-6), post, comb)
        ops_one_by_one = dispatch.counts()
        dispatch.reset_counts()
        got = H.hc_pre(xd, fn, scale, base, w, n, 20, 1e-6, 1e-6)
        assert dispatch.counts() == ops_one_by_one == {("host.hc_mixes", "host"): 1, ("host.hc_collapse", "host"): 1,
                                                       ("host.rms_norm", "host"): 1}
        for a, b in zip(got, want, strict=True):
            assert a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.parametrize("t,n,d", SMALL_SHAPES)
def test_rms_norm_collapse_and_expand_match_reference(lib: H.HostLibrary, t: int, n: int, d: int) -> None:
    g = torch.Generator().manual_seed(t * 7 + d)
    x = torch.randn(t, n, d, generator=g)
    w = torch.randn(d, generator=g)
    pre, post = torch.rand(t, n, generator=g), 2 * torch.rand(t, n, generator=g)
    comb = torch.rand(t, n, n, generator=g)
    y = torch.randn(t, d, generator=g)
    for dtype in (torch.float32, torch.bfloat16):
        ulp = 2.0**-7 if dtype == torch.bfloat16 else 0.0  # one rounding of the result to bf16 (may straddle)
        xd, yd = x.to(dtype), y.to(dtype)
        dispatch.reset_counts()
        for weight in (w, None):
            got, ref = H.rms_norm(xd, weight, 1e-6), R.rms_norm(xd, weight, 1e-6)
            assert got.shape == ref.shape and got.dtype == ref.dtype == dtype
            tol = (2 * d * U + 8 * U + ulp) * ref.float().abs() + 1e-30
            assert bool(((got.float() - ref.float()).abs() <= tol).all())
        got, ref = H.hc_collapse(xd, pre), R.hc_collapse(xd, pre)
        tol = (2 * n * U + ulp) * (pre.unsqueeze(-1) * xd.float()).abs().sum(-2) + ulp * ref.float().abs()
        assert got.dtype == ref.dtype == dtype and bool(((got.float() - ref.float()).abs() <= tol).all())
        got, ref = H.hc_expand(yd, xd, post, comb), R.hc_expand(yd, xd, post, comb)
        terms = (post.unsqueeze(-1) * yd.float().unsqueeze(-2)).abs() + torch.einsum("tjk,tjd->tkd", comb,
                                                                                      xd.float().abs())
        tol = (2 * (n + 1) * U + ulp) * terms + ulp * ref.float().abs()
        assert got.dtype == ref.dtype == dtype and bool(((got.float() - ref.float()).abs() <= tol).all())
        assert dispatch.counts() == {("host.rms_norm", "host"): 2, ("host.hc_collapse", "host"): 1,
                                     ("host.hc_expand", "host"): 1}


@pytest.mark.parametrize("b,t,h,n,d", [(1, 1, 8, 130, 64), (4, 1, 16, 300, 128), (3, 2, 4, 17, 512),
                                       (2, 3, 4, 0, 32)])
def test_sparse_attn_matches_reference(lib: H.HostLibrary, b: int, t: int, h: int, n: int, d: int) -> None:
    g = torch.Generator().manual_seed(b * 100 + n)
    q, kv = torch.randn(b, t, h, d, generator=g), torch.randn(b, n, d, generator=g)
    valid = torch.rand(b, t, n, generator=g) < 0.6
    if n:
        valid[0, 0] = False  # a query that sees no key: output 0 (only the sink)
    sink, scale = torch.randn(h, generator=g), d**-0.5
    for dtype in (torch.float32, torch.bfloat16):
        qd, kd = q.to(dtype), kv.to(dtype)
        dispatch.reset_counts()
        got, ref = H.sparse_attn(qd, kd, valid, sink, scale), R.sparse_attn(qd, kd, valid, sink, scale)
        assert dispatch.counts() == {("host.sparse_attn", "host"): 1}
        assert got.shape == ref.shape and got.dtype == ref.dtype == dtype
        # each logit within 2 D u scale sum|q||k| of the other order; o is a convex combination of the keys (and 0
        # for the sink), so a relative error delta of the weights moves o by <= 2 delta max|k|; + N-term sums, exp.
        qa, ka = qd.float().abs(), kd.float().abs()
        dot_err = (2 * d * U * scale * torch.einsum("bthd,bnd->bthn", qa, ka)).amax(-1, keepdim=True) if n else 0
        kmax = ka.amax((1, 2)).view(b, 1, 1, 1) if n else torch.zeros(b, 1, 1, 1)
        ulp = 2.0**-7 * ref.float().abs() if dtype == torch.bfloat16 else 0.0
        tol = 2 * (2 * dot_err + (2 * n + 8) * U) * kmax + ulp
        assert bool(((got.float() - ref.float()).abs() <= tol).all())
        if n:
            assert bool((got[0, 0] == 0).all())


def test_sparse_attn_with_logits_spread_far_apart_matches_reference(lib: H.HostLibrary) -> None:
    """Logits tens to hundreds apart: most exp(l - m) underflow (the AVX2 path clamps its exp below -87); the output
    is still the reference's within the bound of test_sparse_attn_matches_reference."""
    g = torch.Generator().manual_seed(16)
    b, t, h, n, d = 2, 2, 4, 77, 64
    q, kv = torch.randn(b, t, h, d, generator=g) * 8, torch.randn(b, n, d, generator=g) * 8
    valid, sink, scale = torch.rand(b, t, n, generator=g) < 0.8, torch.randn(h, generator=g) * 50, 1.0
    got, ref = H.sparse_attn(q, kv, valid, sink, scale), R.sparse_attn(q, kv, valid, sink, scale)
    dot_err = (2 * d * U * scale * torch.einsum("bthd,bnd->bthn", q.abs(), kv.abs())).amax(-1, keepdim=True)
    kmax = kv.abs().amax((1, 2)).view(b, 1, 1, 1)
    assert bool(((got - ref).abs() <= 2 * (2 * dot_err + (2 * n + 8) * U) * kmax).all())


@pytest.mark.parametrize("overlap,prev,lead,w,m,c", [
    (True, True, (2,), 1, 4, 16),  # the decode step's CSA pooling: one block per row, the block before as prev
    (True, True, (1,), 1, 4, 256),
    (True, False, (1,), 2, 4, 8),  # a prefill chunk's first blocks: no block before block 0
    (True, True, (), 2, 4, 32),
    (False, False, (2,), 1, 16, 12),  # HCA
    (False, False, (1,), 1, 128, 64),
    (True, True, (3,), 1, 4, 16)])  # above the row limit: the reference (and the check below of the kernel)
def test_compress_pool_matches_reference(lib: H.HostLibrary, overlap: bool, prev: bool, lead: tuple[int, ...], w: int,
                                         m: int, c: int) -> None:
    g = torch.Generator().manual_seed(w * 100 + m + c)
    kv, score = torch.randn(*lead, w, m, c, generator=g), torch.randn(*lead, w, m, c, generator=g) * 4
    pk = ps = None
    if prev:
        pk, ps = torch.randn(*lead, m, c, generator=g), torch.randn(*lead, m, c, generator=g) * 4
        ps[..., :2, :] = float("-inf")  # state rows never written since the slot's reset
    n = 2 * m if overlap else m
    for dtype in (torch.float32, torch.bfloat16):
        args = [t.to(dtype) if t is not None else None for t in (kv, score, pk, ps)]
        dispatch.reset_counts()
        got = H.compress_pool(args[0], args[1], overlap, args[2], args[3])
        ref = R.compress_pool(args[0], args[1], overlap, args[2], args[3])
        rows, limit = math.prod(lead) * w, H.max_m("pool")  # native up to the build's row limit
        assert dispatch.counts() == {("host.compress_pool", "host"): 1} if rows <= limit else \
            dispatch.fallbacks() == {("host.compress_pool", f"M > {limit}"): 1}
        assert got.shape == ref.shape and got.dtype == ref.dtype == torch.float32
        # a convex combination of the slots' kv: each weight exp / sum within (n + 4) u of its exact value on either
        # side (exp ~1 ulp, an n-term sum, a division), the n-term weighted sum within n u more
        kmax = max(float(t.float().abs().max()) for t in (args[0], args[2]) if t is not None)
        assert bool(((got - ref).abs() <= (4 * n + 16) * U * kmax).all())


@pytest.mark.parametrize("b,hi,di,n", [(1, 32, 128, 275), (3, 6, 24, 17), (2, 5, 13, 1)])
def test_index_score_matches_reference(lib: H.HostLibrary, b: int, hi: int, di: int, n: int) -> None:
    g = torch.Generator().manual_seed(hi * 1000 + n)
    q, keys, w = torch.randn(b, 1, hi, di, generator=g), torch.randn(b, n, di, generator=g), torch.randn(b, 1, hi)
    for dtype in (torch.float32, torch.bfloat16):
        args = [t.to(dtype) for t in (q, keys, w)]
        dispatch.reset_counts()
        H.index_score(*args)  # native up to the build's row limit, else the reference, counted by reason
        limit = H.max_m("index")
        assert dispatch.counts() == {("host.index_score", "host"): 1} if b <= limit else \
            dispatch.fallbacks() == {("host.index_score", f"M > {limit}"): 1}
        got, ref = H.index_score_native(*args), R.index_score(*args)
        assert got.shape == ref.shape == (b, 1, n) and got.dtype == ref.dtype == torch.float32
        # each head's dot within 2 Di u sum|q||k| of the other order (ReLU adds none), the Hi-term weighted sum
        # within 2 Hi u more: both times |w|
        qa, ka, wa = (t.float().abs() for t in args)
        dots = torch.einsum("bthd,bnd->bthn", qa, ka)
        tol = 2 * (di + hi + 2) * U * torch.einsum("bthn,bth->btn", dots, wa)
        assert bool(((got - ref).abs() <= tol).all())


def test_index_score_runs_prefill_rows_on_the_reference() -> None:
    """Chunks (T > 1) keep the reference's one batched matmul; counted by reason."""
    q, keys, w = torch.randn(1, 3, 4, 8), torch.randn(1, 5, 8), torch.randn(1, 3, 4)
    dispatch.reset_counts()
    assert torch.equal(H.index_score(q, keys, w), R.index_score(q, keys, w))
    assert dispatch.fallbacks() == {("host.index_score", "T > 1"): 1}


def test_compress_pool_declines_what_it_does_not_take() -> None:
    """The reference, counted by reason: a block without its W dim, float64, autograd."""
    kv = torch.randn(2, 1, 4, 8)
    dispatch.reset_counts()
    for args in ((kv[0, 0], kv[0, 0], False), (kv.double(), kv.double(), True), (kv.requires_grad_(), kv, False)):
        assert torch.equal(H.compress_pool(*args), R.compress_pool(*args))
    assert dispatch.fallbacks() == {("host.compress_pool", "shape"): 1, ("host.compress_pool", "dtype"): 1,
                                    ("host.compress_pool", "autograd"): 1}


@pytest.mark.parametrize("h,n,d", [(16, 140, 128), (5, 33, 16), (3, 17, 8), (2, 9, 24), (7, 64, 12)])
def test_sparse_attn_heads_together_equal_each_head_alone(lib: H.HostLibrary, h: int, n: int, d: int) -> None:
    """The kernel takes a query row's heads `attn_heads` at a time (each key chunk loaded once for them): every head's
    output is bit for bit the one of that head in a call of its own (the same FMAs in the same order), with odd head
    counts (a last group of one), key counts off the 8-key blocks, D off the 32-column blocks and a head whose logits
    are all NaN beside one that has values."""
    g = torch.Generator().manual_seed(h * 1000 + n)
    q, kv = torch.randn(2, 2, h, d, generator=g), torch.randn(2, n, d, generator=g)
    valid, sink = torch.rand(2, 2, n, generator=g) < 0.7, torch.randn(h, generator=g)
    valid[1, 1] = False  # a row that sees no key
    q[0, 1, 0, 0] = float("nan")  # head 0 of a row with only NaN logits (0 out); its group partner keeps its values
    got = H.sparse_attn(q, kv, valid, sink, d**-0.5)
    for i in range(h):
        alone = H.sparse_attn(q[:, :, i: i + 1].contiguous(), kv, valid, sink[i: i + 1].contiguous(), d**-0.5)
        assert torch.equal(got[:, :, i: i + 1], alone), f"head {i}"


def test_sparse_attn_refuses_short_scratch(lib: H.HostLibrary) -> None:
    """The scratch the caller passes is checked against what the head groups need (2 * attn_heads * N floats a
    thread, attn_heads as the library reports it): the native call returns -2 instead of writing past it."""
    q, kv, o = torch.randn(1, 1, 4, 8), torch.randn(1, 10, 8), torch.empty(1, 1, 4, 8)
    valid, sink = torch.ones(1, 1, 10, dtype=torch.bool), torch.zeros(4)
    need = 2 * lib.attn_heads * 10
    for size, rc in ((need - 1, -2), (need, 0)):
        scratch = torch.empty(size)
        assert lib.lib.dk_sparse_attn(q.data_ptr(), kv.data_ptr(), valid.data_ptr(), sink.data_ptr(), o.data_ptr(),
                                      scratch.data_ptr(), size, 1, 1, 4, 10, 8, 1.0, 1) == rc


def test_small_ops_above_the_threshold_or_odd_run_the_reference(lib: H.HostLibrary) -> None:
    g = torch.Generator().manual_seed(12)
    m = H.max_m("mhc")
    x, fn, scale, base = _mhc_inputs(m + 1, 4, 32, g)
    dispatch.reset_counts()
    got = H.hc_mixes(x, fn, scale, base, 4, 20, 1e-6, 1e-6)
    assert all(torch.equal(a, b) for a, b in zip(got, R.hc_mixes(x, fn, scale, base, 4, 20, 1e-6, 1e-6),
                                                 strict=True))
    assert torch.equal(H.rms_norm(x, None, 1e-6), R.rms_norm(x, None, 1e-6))  # (m+1) * 4 rows
    assert torch.equal(H.rms_norm(x.double(), None, 1e-6), R.rms_norm(x.double(), None, 1e-6))
    q, kv = torch.randn(1, 1, 2, 8, generator=g), torch.randn(1, 3, 8, generator=g).half()
    valid, sink = torch.ones(1, 1, 3, dtype=torch.bool), torch.zeros(2)
    assert torch.equal(H.sparse_attn(q, kv, valid, sink, 1.0), R.sparse_attn(q, kv, valid, sink, 1.0))  # fp16 keys
    ma = H.max_m("sparse_attn")
    q, kv = torch.randn(1, ma + 1, 2, 8, generator=g), torch.randn(1, 3, 8, generator=g)
    valid = torch.ones(1, ma + 1, 3, dtype=torch.bool)
    assert torch.equal(H.sparse_attn(q, kv, valid, sink, 1.0), R.sparse_attn(q, kv, valid, sink, 1.0))
    assert dispatch.fallbacks() == {("host.hc_mixes", f"M > {m}"): 1, ("host.rms_norm", f"M > {m}"): 1,
                                    ("host.rms_norm", "dtype"): 1, ("host.sparse_attn", "dtype"): 1,
                                    ("host.sparse_attn", f"M > {ma}"): 1}


def test_stack_linear_reads_the_chosen_expert_in_place(lib: H.HostLibrary) -> None:
    """`ops.stack_linear` (the MoE gather path): the host table indexes the stack, the reference gathers a copy;
    the same GEMM on the same weight either way, eagerly and inside a compiled graph (a custom op)."""
    from engine.model.ops import REFERENCE, ops_for

    g = torch.Generator().manual_seed(14)
    w8, s8 = zip(*[_fp8(64, 128, g) for _ in range(3)], strict=True)
    w4, s4 = zip(*[_fp4(64, 128, g) for _ in range(3)], strict=True)
    cases = [(torch.stack(w8), torch.stack(s8), "fp8"), (torch.stack(w4), torch.stack(s4), "fp4"),
             (torch.randn(3, 64, 128, generator=g).bfloat16(), None, None)]
    x, i = torch.randn(1, 128, generator=g), torch.tensor([2])
    ops = ops_for("host")
    for stack, scales, fmt in cases:
        want = REFERENCE.stack_linear(x, stack, scales, i, fmt)
        assert torch.equal(ops.stack_linear(x, stack, scales, i, fmt),
                           NATIVE[fmt or "linear"](x, stack[2], *(() if scales is None else (scales[2],))))
        _assert_close(ops.stack_linear(x, stack, scales, i, fmt), want, x,
                      _dense(fmt or "linear", stack[2], *(() if scales is None else (scales[2],))))
        torch._dynamo.reset()
        compiled = torch.compile(lambda x, i, s=stack, c=scales, f=fmt: ops.stack_linear(x, s, c, i, f),
                                 backend="aot_eager", fullgraph=True)
        assert torch.equal(compiled(x, i), ops.stack_linear(x, stack, scales, i, fmt))


def test_native_clock_counts_and_times_every_call_while_installed(lib: H.HostLibrary) -> None:
    """engine/host_kernels/clock.py: each `dk_*` call through the library counted once under its own name (a GEMM
    inside another native call is not), only between install() and remove(), which puts the library back."""
    from engine.host_kernels.clock import NativeClock

    g = torch.Generator().manual_seed(21)
    w8, s8 = _fp8(64, 128, g)
    x = torch.randn(1, 128, generator=g)
    real = lib.lib
    clock = NativeClock(lib)
    plain = H.fp8_linear(x, w8, s8)  # not installed: not counted
    clock.install()
    try:
        y = H.fp8_linear(x, w8, s8)
        H.fp8_linear(x, w8, s8)
        H.rms_norm(x, None, 1e-6)
    finally:
        clock.remove()
    assert lib.lib is real
    H.fp8_linear(x, w8, s8)
    assert torch.equal(y, plain)  # the same native call
    assert dict(clock.calls) == {"dk_fp8_linear": 2, "dk_rms_norm": 1}
    rows = clock.rows()
    assert {r["kernel"] for r in rows} == {"dk_fp8_linear", "dk_rms_norm"} and all(r["total_ms"] > 0 for r in rows)
    assert rows == sorted(rows, key=lambda r: -r["total_ms"])


def test_keep_rows_writes_the_torch_mean_or_declines() -> None:
    """small_ops.keep_rows (the runner's held rows written at once) averages each source's streams as torch does:
    its sum over the streams adds them in order from 0 for n <= 4 streams or D a multiple of 64 (pinned here on this
    CPU's torch kernels: the native code's order), where it writes bit for bit `Capture.tensor()`'s rows, the later of
    a row kept twice winning; elsewhere (and for a bf16, non-contiguous or non-CPU tensor) it writes nothing and
    says so, and the runner keeps its torch path."""
    from engine.host_kernels.small_ops import keep_rows
    from engine.model.dspark_proposer import Capture

    g = torch.Generator().manual_seed(0)
    for n, d in ((1, 37), (4, 37), (8, 64), (16, 128), (4, 7168)):
        x = torch.randn(3, n, d, generator=g)
        in_order = x[:, 0] + 0.0
        for j in range(1, n):
            in_order = in_order + x[:, j]
        assert torch.equal(torch.sum(x, 1).view(torch.int32), in_order.view(torch.int32)), (n, d)
        src = [torch.randn(6, n, d, generator=g) for _ in range(2)]
        held, ids = torch.full((5, 2 * d), 7.0), torch.zeros(5, dtype=torch.long)
        assert keep_rows(src, [0, 4, 5, 2], [3, 1, 3, 0], [9, 8, 7, 6], True, held, ids)
        made = Capture(src).tensor()
        assert torch.equal(held[3].view(torch.int32), made[5].view(torch.int32)) and int(ids[3]) == 7  # the later
        assert torch.equal(held[[1, 0]].view(torch.int32), made[[4, 2]].view(torch.int32))
        assert torch.equal(held[[2, 4]], torch.full((2, 2 * d), 7.0)) and ids.tolist() == [6, 8, 0, 7, 0]
    held, ids = torch.zeros(4, 64), torch.zeros(4, dtype=torch.long)
    x = torch.randn(2, 8, 32, generator=g)
    assert not keep_rows([x, x], [0], [1], [5], True, held, ids)  # 8 streams of 32: torch's order differs
    assert not keep_rows([x.bfloat16()] * 2, [0], [1], [5], True, held, ids)
    assert not keep_rows([x.transpose(0, 1)] * 2, [0], [1], [5], True, held, ids)
    assert held.count_nonzero() == 0 and ids.count_nonzero() == 0
    copy = torch.zeros(3, 2 * 8 * 32)
    assert keep_rows([x, x], [1], [2], [4], False, copy, torch.zeros(3, dtype=torch.long))  # copied, any shape
    assert torch.equal(copy[2], torch.cat([x[1].flatten(), x[1].flatten()]))
    with pytest.raises(IndexError, match="outside"):
        keep_rows([x, x], [2], [0], [4], False, copy, torch.zeros(3, dtype=torch.long))
    assert keep_rows([x, x], [], [], [], False, copy, torch.zeros(3, dtype=torch.long))  # no row: nothing to write
