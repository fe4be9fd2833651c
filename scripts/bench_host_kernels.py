#!/usr/bin/env python
"""Per-op timings of `--kernels host` (engine/host_kernels), every build this CPU runs, against the torch reference,
on the mid-size V4 shapes (golden/make_bench_model.py --preset mid).

    DEEPINFER_NUM_THREADS=1 taskset -c 0 python scripts/bench_host_kernels.py [--m 1,4,16] [--repeats 9]
        [--builds all] [--shapes head,wq_b,...] [--small-ops] [--warm] [--burst 8]

First every build variant with its status (ran / not run: <reason>, engine/host_kernels/build.py), then the memory
roof: a copy probe (256 MiB, read + write bytes / time) before and after the timings, min / median. Then per (op,
shape, M) the median ms per call of the reference and of each build (in turns of `--burst` calls in a row, as a
decode step calls its kernels back to back, the turns interleaved in a random order per round, so load from other
processes on a shared box hits all alike), each build's GB/s of stored weight bytes (bf16 head: 2 B/element, FP8:
1 B + scales, FP4: 0.5 B + scales; at the median, and at the fastest turn) and its speedup over the reference (the
median over rounds of reference time / build time in the same round; marked * where M is above the build's row
threshold MAX_M, i.e. where `--kernels host` itself runs the reference: the kernels are timed at every M regardless).
Weights are cold by default, as in a decode step: each call reads the next of enough copies to exceed twice the
last-level cache (`--warm`: one copy, cache-resident where it fits). Random weights with the checkpoint's formats
(FP8 codes without the NaN code, UE8M0 scales near 2^-7; `--fp8-codes checkpoint`: a Gaussian quantised as the
checkpoints are, far fewer subnormal codes, which an avx2 build on Intel pays for: README). `--small-ops` adds the
per-token ops of mhc.c at decode sizes (no GB/s: they are not weight-bound). The load average is printed: rerun when
it is high.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine import host_kernels as H  # noqa: E402
from engine.envs import get_envs  # noqa: E402
from engine.host_memory import host_buffer, place, thp_mode, why_not  # noqa: E402
from nki_kernels import reference as R  # noqa: E402
from nki_kernels.formats import quant_fp8_block  # noqa: E402

# name: (op, N, K) at the mid model's sizes (D 1024, q_lora 512, 16 x 128 heads, moe_inter 512, vocab 129280)
SHAPES = {
    "head": ("linear", 129280, 1024),  # bf16 [vocab, D]
    "wq_b": ("fp8", 2048, 512),
    "wo_b": ("fp8", 1024, 1024),
    "wq_a": ("fp8", 512, 1024),
    "fp8_4096": ("fp8", 4096, 1024),
    "expert_w1": ("fp4", 512, 1024),
    "expert_w2": ("fp4", 1024, 512),
}
REF = {"linear": R.linear, "fp8": R.fp8_linear, "fp4": R.fp4_linear}
MAX_COPIES = 4096  # weight copies per shape (cold: enough to fill twice the last-level cache; 64 MiB at 32 MiB)
NAT = {"linear": H.gemm.linear_impl, "fp8": H.gemm.fp8_linear_impl, "fp4": H.gemm.fp4_linear_impl}


def _fp8_checkpoint(n: int, k: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A Gaussian weight quantised as DeepSeek's checkpoints are (the loader's `quant_fp8_block`: per 128 x 128 block
    a power-of-two scale, codes rounded to e4m3; few subnormal codes: ~1e-4, where random bytes give 5.5 %)."""
    w8, scale = quant_fp8_block(torch.randn(n, k, generator=g))
    return w8.view(torch.uint8), scale.view(torch.uint8)


def _weights(op: str, n: int, k: int, seed: int, fp8_codes: str = "random") -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    if op == "linear":
        return (torch.randn(n, k, generator=g).bfloat16(),)
    if op == "fp8" and fp8_codes == "checkpoint":
        return _fp8_checkpoint(n, k, g)
    if op == "fp8":
        w = torch.randint(0, 256, (n, k), dtype=torch.uint8, generator=g)
        w[(w & 0x7F) == 0x7F] = 0
        return w, torch.randint(118, 124, (-(-n // 128), -(-k // 128)), dtype=torch.uint8, generator=g)
    return (torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g),
            torch.randint(118, 124, (n, k // 32), dtype=torch.uint8, generator=g))


def _bytes(ws: tuple[torch.Tensor, ...]) -> int:
    return sum(w.numel() * w.element_size() for w in ws)


def last_level_cache() -> int:
    """Bytes of the largest CPU cache sysfs reports (64 MiB if it says nothing)."""
    best = 0
    for d in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            size = (d / "size").read_text().strip().upper()
            best = max(best, int(size.rstrip("KMG")) << {"K": 10, "M": 20, "G": 30}.get(size[-1], 0))
        except (OSError, ValueError):
            continue
    return best or 64 << 20


def _copies(nbytes: int, warm: bool) -> int:
    """Weight copies of one shape: one warm, else enough to fill twice the last-level cache (capped: MAX_COPIES)."""
    return 1 if warm else max(1, min(MAX_COPIES, -(-2 * last_level_cache() // nbytes)))


def bandwidth_probe(rounds: int = 5) -> list[float]:
    """256 MiB copies (read + write GB/s), the buffers placed as the weights are (`host_buffer`)."""
    mode = get_envs().DEEPINFER_HOST_HUGE_PAGES
    a = host_buffer(256 << 20, mode)[0].view(torch.float32).fill_(1.0)
    b = host_buffer(256 << 20, mode)[0].view(torch.float32)
    b.copy_(a)
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        b.copy_(a)
        out.append(2 * a.numel() * 4 / (time.perf_counter() - t0) / 1e9)
    return out


# column -> the FP8 decoder its calls use (the avx2 build's two, gemv_avx2.h; the column named after the build uses
# the one this CPU chooses, the engine's)
DECODER: dict[str, str] = {}


def _libs(builds: str) -> dict[str, H.HostLibrary]:
    """The builds to time (all: every one that may run here), after printing every variant's status; the avx2 build
    also as a second column with the FP8 decoder this CPU does not choose ("avx2/f16c" or "avx2/shift")."""
    cc = get_envs().DEEPINFER_HOST_CC
    want = list(H.VARIANTS) if builds == "all" else builds.split(",")
    libs = {}
    for name in H.VARIANTS:
        why = H.why_not(name, cc, H.build.simd_cap())
        if name in want and why is None:
            lib = libs[name] = H.load(name, cc)
            print(f"  build {name:<12} ran ({lib.path.name})")
            if lib.fp8_decoder != "only":
                other = "shift" if lib.fp8_decoder == "f16c" else "f16c"
                DECODER[name], DECODER[f"{name}/{other}"] = lib.fp8_decoder, other
                libs[f"{name}/{other}"] = lib
                print(f"    FP8 decoder {lib.fp8_decoder_info()}; column {name}/{other}: the other one")
        else:
            print(f"  build {name:<12} not run: {why or 'not asked for (--builds)'}")
    return libs


def _timed(fns: dict[str, Callable[[int], object]], libs: dict[str, H.HostLibrary], repeats: int,
           budget_s: float, burst: int = 1) -> dict[str, list[float]]:
    """Every impl one turn per round, in a new (seeded) random order each round: no impl always runs right after the
    same other one (the reference's dequantised temporaries leave the cache full of dirty lines; with a rotated
    fixed order one build always followed it and measured up to 1.4x slow). Each turn is `burst` calls in a row,
    timed together (seconds per call: the burst's time / burst), as a decode step runs its kernels back to back:
    one call right after the reference's ran up to 3x slower than calls in a row (expert_w1 FP4, one row, Zen 4:
    109 vs 34 us). Each call reads the next weight copy (`fn(j)`, j counting calls, not rounds: with the copies
    twice the last-level cache, no call finds its weights left in cache by another call); seconds per call, per
    impl."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    names = list(fns)
    t_end = time.perf_counter() + budget_s
    j = 0
    for i in range(repeats + 1):
        for name in random.Random(i).sample(names, len(names)):
            fn = fns[name]
            if name in libs:
                H._lib = libs[name]
                if name in DECODER:
                    libs[name].set_fp8_decoder(DECODER[name])
            t0 = time.perf_counter()
            for _ in range(burst):
                fn(j)
                j += 1
            if i:  # the first round warms up
                times[name].append((time.perf_counter() - t0) / burst)
        if i >= 3 and time.perf_counter() > t_end:
            break
    return times


def _row(label: str, times: dict[str, list[float]], nbytes: int | None, builds: list[str],
         native: dict[str, bool]) -> str:
    ref = statistics.median(times["reference"])
    cells = [f"{label} {ref * 1e3:>9.3f}"]
    for b in builds:
        med, best = statistics.median(times[b]), min(times[b])
        rate = f"{nbytes / med / 1e9:>6.2f} {nbytes / best / 1e9:>6.2f}" if nbytes else f"{'-':>6} {'-':>6}"
        speedup = statistics.median(r / t for r, t in zip(times["reference"], times[b], strict=True))  # per round
        cells.append(f"{med * 1e3:>9.3f} {rate} {speedup:>6.2f}x{' ' if native[b] else '*'}")
    return " | ".join(cells)


def _header(builds: list[str], first: str) -> str:
    cells = [f"{first} {'ref ms':>9}"]
    cells += [f"{b[:9] + ' ms':>9} {'GB/s':>6} {'best':>6} {'x ref':>8}" for b in builds]
    return " | ".join(cells)


def _small_ops(ms: list[int], libs: dict[str, H.HostLibrary], repeats: int,
               limits: dict[str, dict[str, int]], burst: int = 1) -> None:
    g = torch.Generator().manual_seed(1)
    n, d, heads, hd, keys = 4, 1024, 16, 128, 384  # mid: hc_mult 4, D 1024, 16 x 128 heads, 128 window + 256 top-k
    print(_header(list(libs), f"{'op':<12} {'shape':<22} {'M':>3}"))
    for m in ms:
        x = torch.randn(m, n, d, generator=g)
        fn = torch.randn((2 + n) * n, n * d, generator=g) / (n * d) ** 0.5
        scale, base = torch.rand(3, generator=g) + 0.5, torch.randn((2 + n) * n, generator=g)
        pre, post, comb = torch.rand(m, n, generator=g), torch.rand(m, n, generator=g), torch.rand(m, n, n, generator=g)
        y, w = torch.randn(m, d, generator=g), torch.randn(d, generator=g)
        q, kv = torch.randn(1, m, heads, hd, generator=g), torch.randn(1, keys, hd, generator=g)
        valid, sink = torch.rand(1, m, keys, generator=g) < 0.9, torch.randn(heads, generator=g)
        # a decode step's closing CSA block per row (m = 4, 2 x 128 channels, the block before as prev), and the
        # indexer's scores of a row over 275 entries (32 x 128 heads: mid at ctx 1100)
        ckv, csc = torch.randn(m, 1, 4, 2 * hd, generator=g), torch.randn(m, 1, 4, 2 * hd, generator=g)
        pkv, psc = torch.randn(m, 4, 2 * hd, generator=g), torch.randn(m, 4, 2 * hd, generator=g)
        iq, ik, iw = torch.randn(m, 1, 32, hd, generator=g), torch.randn(m, 275, hd, generator=g), \
            torch.randn(m, 1, 32, generator=g)
        cases = {
            "hc_mixes": (f"x [{m},{n},{d}]", lambda mod, *a: mod.hc_mixes(*a),
                         (x, fn, scale, base, n, 20, 1e-6, 1e-6)),
            "rms_norm": (f"x [{m},{d}]", lambda mod, *a: mod.rms_norm(*a), (y, w, 1e-6)),
            "hc_collapse": (f"x [{m},{n},{d}]", lambda mod, *a: mod.hc_collapse(*a), (x, pre)),
            "hc_expand": (f"x [{m},{n},{d}]", lambda mod, *a: mod.hc_expand(*a), (y, x, post, comb)),
            "sparse_attn": (f"q [1,{m},{heads},{hd}] kv {keys}", lambda mod, *a: mod.sparse_attn(*a),
                            (q, kv, valid, sink, hd**-0.5)),
            "compress_pool": (f"kv [{m},1,4,{2 * hd}] + prev", lambda mod, *a: mod.compress_pool(*a),
                              (ckv, csc, True, pkv, psc)),
            "index_score": (f"q [{m},1,32,{hd}] k 275", lambda mod, *a: mod.index_score(*a), (iq, ik, iw)),
        }
        for op, (shape, call, args) in cases.items():
            fns: dict[str, Callable[[int], object]] = {"reference": lambda i, c=call, a=args: c(R, *a)}
            for b in libs:
                fns[b] = lambda i, c=call, a=args: c(H, *a)
            key = {"sparse_attn": "sparse_attn", "compress_pool": "pool", "index_score": "index"}.get(op, "mhc")
            print(_row(f"{op:<12} {shape:<22} {m:>3}", _timed(fns, libs, repeats, 3.0, burst), None, list(libs),
                       {b: m <= limits[libs[b].variant][key] for b in libs}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", default="1,4,16", help="x row counts")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--builds", default="all", help="comma-separated builds to time (all: every one this CPU runs)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--small-ops", action="store_true",
                    help="also time the per-token ops (mhc.c; attn.c's compress_pool and index_score)")
    ap.add_argument("--warm", action="store_true", help="one weight copy (cache-resident where it fits)")
    ap.add_argument("--burst", type=int, default=8, help="calls in a row per impl and round, timed together")
    ap.add_argument("--fp8-codes", default="random", choices=["random", "checkpoint"],
                    help="FP8 weights: random bytes (5.5 %% subnormal e4m3 codes: the worst case for a CPU that "
                    "takes an assist on subnormal floats, as Intel cores do) or a Gaussian quantised per 128 x 128 "
                    "block as checkpoints are (~1e-4 subnormal)")
    a = ap.parse_args()
    threads = get_envs().DEEPINFER_NUM_THREADS
    if threads:
        torch.set_num_threads(threads)
    print(f"load average {os.getloadavg()}, torch threads {torch.get_num_threads()}, "
          f"{'warm' if a.warm else 'cold'} weights (last-level cache {last_level_cache() >> 20} MiB), "
          f"FP8 codes {a.fp8_codes}")
    print(H.summary())
    why = why_not(get_envs().DEEPINFER_HOST_HUGE_PAGES)
    print(f"weights and roof buffers: {'on huge pages' if why is None else f'4 KiB pages ({why})'} (kernel THP mode "
          f"{thp_mode()}; DEEPINFER_HOST_HUGE_PAGES, engine/host_memory.py)")
    libs = _libs(a.builds)
    builds = list(libs)
    roof = bandwidth_probe()
    saved = {b: dict(lim) for b, lim in H.MAX_M.items()}
    for lim in H.MAX_M.values():
        lim.update({k: 1 << 30 for k in lim})  # time the native kernel at every M asked for
    try:
        print(_header(builds, f"{'shape':<10} {'op':<6} {'N':>6} {'K':>5} {'M':>3}"))
        for name in a.shapes.split(","):
            op, n, k = SHAPES[name]
            one = _weights(op, n, k, 0, a.fp8_codes)
            copies = _copies(_bytes(one), a.warm)
            ws = [one] + [_weights(op, n, k, c, a.fp8_codes) for c in range(1, copies)]
            place([t for w in ws for t in w], get_envs().DEEPINFER_HOST_HUGE_PAGES)  # as the engine's weights
            for m in (int(v) for v in a.m.split(",")):
                x = torch.randn(m, k).to(getattr(torch, a.dtype))
                fns: dict[str, Callable[[int], object]] = {
                    "reference": lambda i, op=op, x=x, ws=ws: REF[op](x, *ws[i % len(ws)])}
                for b in builds:
                    fns[b] = lambda i, op=op, x=x, ws=ws: NAT[op](x, *ws[i % len(ws)])
                times = _timed(fns, libs, a.repeats, 6.0, a.burst)
                print(_row(f"{name:<10} {op:<6} {n:>6} {k:>5} {m:>3}", times, _bytes(one), builds,
                           {b: m <= saved[libs[b].variant][op] for b in builds}), flush=True)
            del ws
        if a.small_ops:
            _small_ops([int(v) for v in a.m.split(",")], libs, a.repeats, saved, a.burst)
    finally:
        for b, lim in saved.items():
            H.MAX_M[b].update(lim)
    roof += bandwidth_probe()
    print(f"memory roof (256 MiB copy, read + write, {len(roof)} runs before and after): min {min(roof):.1f}, median "
          f"{statistics.median(roof):.1f}, max {max(roof):.1f} GB/s")
    print("*: above the build's row threshold (MAX_M): `--kernels host` runs the reference there, not this kernel")


if __name__ == "__main__":
    main()
