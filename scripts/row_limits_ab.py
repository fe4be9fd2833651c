#!/usr/bin/env python
"""Decode speed under two sets of host-kernel row limits, interleaved in one process (a benchmark command, not a
test): what a change of `engine/host_kernels/native.py` MAX_M does to whole engine steps, where the per-kernel
crossovers of `scripts/bench_host_kernels.py` say what it does to one kernel alone.

    python scripts/row_limits_ab.py --model-dir golden/tiny-spec --batches 8,16,32,48 --b fp8=32,linear=32,index=8
    python scripts/row_limits_ab.py --model-dir golden/bench/mid --batches 8 --input-len 1100 --new 12 --b index=1

Two engines of the model (`scripts/spec_bench.py build_engine`, plain decoding unless `--speculative`): A runs
under the build's limits as they are, B under them with `--b`'s keys replaced; each repeat runs the same greedy
batch on both, in turns (A first on even repeats). The limits are switched before each run (a fused decode call
reads them at each call). Columns: CPU ms per decode step (the process's CPU time, one torch thread) of A and B,
A / B of the sums (> 1: B faster) and the median of each repeat's ratio. The machine's load moves single runs by
several per cent: compare only within one run.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for p in (ROOT, ROOT / "scripts"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))


def parse_limits(text: str) -> dict[str, int]:
    """`key=value,...` -> {key: value}, keys from MAX_M."""
    from engine.host_kernels import native

    out = {}
    for part in filter(None, text.split(",")):
        key, _, value = part.partition("=")
        if key not in native.MAX_M["portable"] or not value.isdigit():
            keys = ", ".join(native.MAX_M["portable"])
            raise SystemExit(f"--b: {part!r} is not key=rows with a key of MAX_M ({keys})")
        out[key] = int(value)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-dir", default="golden/tiny-spec")
    ap.add_argument("--batches", default="8,16,32,48")
    ap.add_argument("--b", required=True, help="B's limits: key=rows, comma-separated (e.g. fp8=32,linear=32)")
    ap.add_argument("--input-len", type=int, default=40)
    ap.add_argument("--new", type=int, default=16, help="tokens generated per request")
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("--speculative", default="none", help="none, mtp (k = 2, always) or dspark")
    ap.add_argument("--seed", type=int, default=20290)
    args = ap.parse_args()

    import torch

    torch.set_num_threads(1)
    from spec_bench import build_engine, timed_run

    from engine.host_kernels import native
    from golden.train_draft_heads import make_prompts

    batches = [int(b) for b in args.batches.split(",")]
    limits = native.MAX_M[native._native().variant]
    a_limits, b_limits = dict(limits), {**limits, **parse_limits(args.b)}
    longest = args.input_len + args.new + 6
    engines = {s: build_engine(Path(args.model_dir), max(batches), longest, args.speculative, 2, 1, "always")
               for s in "AB"}

    def run(s: str, prompts: list[list[int]], new: int) -> dict:
        if s == "B":
            limits.update(b_limits)
        try:
            return timed_run(engines[s], prompts, new)
        finally:
            limits.update(a_limits)

    print(f"build {native._native().variant}; A: its limits; B: {args.b}", flush=True)
    for b in batches:  # untimed first runs
        for s in "AB":
            run(s, make_prompts(b, args.seed - 1, (args.input_len, args.input_len)), 4)
    runs: dict[tuple[int, str], list[dict]] = {}
    for r in range(args.repeats):
        for b in batches:
            prompts = make_prompts(b, args.seed + 1000 * r + b, (args.input_len, args.input_len))
            for s in "AB" if r % 2 == 0 else "BA":
                runs.setdefault((b, s), []).append(run(s, prompts, args.new))
    print("| batch | A CPU ms/step | B CPU ms/step | A / B | median of repeats |\n|---|---|---|---|---|")
    for b in batches:
        ra, rb = runs[(b, "A")], runs[(b, "B")]
        ca, cb = (sum(x["decode_cpu_s"] for x in rs) for rs in (ra, rb))
        sa, sb = (sum(x["decode_steps"] for x in rs) for rs in (ra, rb))
        med = statistics.median(x["decode_cpu_s"] / y["decode_cpu_s"] for x, y in zip(ra, rb, strict=True))
        print(f"| {b} | {1e3 * ca / sa:.2f} | {1e3 * cb / sb:.2f} | {ca / cb:.2f}x | {med:.2f}x |")


if __name__ == "__main__":
    main()
