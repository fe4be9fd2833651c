#!/usr/bin/env python
"""Per-op timings of `--kernels host` (engine/host_kernels) against the torch reference, on the mid-size V4 shapes.

    DEEPINFER_NUM_THREADS=1 python scripts/bench_host_kernels.py [--m 1,4,16] [--repeats 7] [--shapes head,wq_b,...]

For each (op, shape, M): median ms of the native kernel and of `nki_kernels.reference`, the speedup, and GB/s of
stored weight bytes read by the native kernel (bf16 head: 2 B/element, FP8: 1 B + scales, FP4: 0.5 B + scales),
plus a memory-bandwidth probe (a 256 MiB copy: read + write bytes / time). Random weights with the checkpoint's
formats (FP8 codes without the NaN code, UE8M0 scales near 2^-7). The machine's load average is printed first:
rerun when it is high (the box may be shared).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine import host_kernels as H  # noqa: E402
from engine.envs import get_envs  # noqa: E402
from nki_kernels import reference as R  # noqa: E402

# name: (op, N, K) at the mid model's sizes (golden/bench/mid: D 1024, q_lora 512, 16 x 128 heads, moe_inter 512)
SHAPES = {
    "head": ("linear", 129280, 1024),  # bf16 [vocab, D]
    "wq_b": ("fp8", 2048, 512),
    "wo_b": ("fp8", 1024, 1024),
    "wq_a": ("fp8", 512, 1024),
    "fp8_4096": ("fp8", 4096, 1024),
    "expert_w1": ("fp4", 512, 1024),
    "expert_w2": ("fp4", 1024, 512),
}


def _weights(op: str, n: int, k: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)
    if op == "linear":
        return (torch.randn(n, k, generator=g).bfloat16(),)
    if op == "fp8":
        w = torch.randint(0, 256, (n, k), dtype=torch.uint8, generator=g)
        w[(w & 0x7F) == 0x7F] = 0
        return w, torch.randint(118, 124, (-(-n // 128), -(-k // 128)), dtype=torch.uint8, generator=g)
    return (torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g),
            torch.randint(118, 124, (n, k // 32), dtype=torch.uint8, generator=g))


def _bytes(ws: tuple[torch.Tensor, ...]) -> int:
    return sum(w.numel() * w.element_size() for w in ws)


def _time(fn, repeats: int, budget_s: float = 3.0) -> float:
    fn()
    times: list[float] = []
    t_end = time.perf_counter() + budget_s
    while len(times) < repeats and (len(times) < 3 or time.perf_counter() < t_end):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def bandwidth_probe() -> float:
    a = torch.ones(64 << 20)  # 256 MiB
    b = torch.empty_like(a)
    ms = _time(lambda: b.copy_(a), 5)
    return 2 * a.numel() * 4 / ms / 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--m", default="1,4,16", help="x row counts")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    a = ap.parse_args()
    threads = get_envs().DEEPINFER_NUM_THREADS
    if threads:
        torch.set_num_threads(threads)
    lib = H.library()
    print(f"load average {os.getloadavg()}, torch threads {torch.get_num_threads()}, library {lib.simd} "
          f"({lib.path.name}), MAX_M {H.MAX_M}")
    print(f"memory bandwidth probe (256 MiB copy): {bandwidth_probe():.1f} GB/s")
    ref = {"linear": R.linear, "fp8": R.fp8_linear, "fp4": R.fp4_linear}
    nat = {"linear": H.linear_impl, "fp8": H.fp8_linear_impl, "fp4": H.fp4_linear_impl}
    print(f"{'shape':<10} {'op':<6} {'N':>7} {'K':>5} {'M':>3} {'native ms':>10} {'ref ms':>9} {'speedup':>8} "
          f"{'GB/s':>6}")
    saved = dict(H.MAX_M)
    H.MAX_M.update({k: 1 << 30 for k in H.MAX_M})  # time the native kernel at every M asked for
    try:
        for name in a.shapes.split(","):
            op, n, k = SHAPES[name]
            ws = _weights(op, n, k)
            for m in (int(v) for v in a.m.split(",")):
                x = torch.randn(m, k).to(getattr(torch, a.dtype))
                t_nat = _time(lambda: nat[op](x, *ws), a.repeats)  # noqa: B023
                t_ref = _time(lambda: ref[op](x, *ws), a.repeats)  # noqa: B023
                print(f"{name:<10} {op:<6} {n:>7} {k:>5} {m:>3} {t_nat:>10.3f} {t_ref:>9.3f} {t_ref / t_nat:>7.2f}x "
                      f"{_bytes(ws) / t_nat / 1e6:>6.1f}", flush=True)
    finally:
        H.MAX_M.update(saved)


if __name__ == "__main__":
    main()
