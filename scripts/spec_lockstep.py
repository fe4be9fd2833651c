#!/usr/bin/env python
"""Speculation against plain decoding with the engines stepped in lockstep (a benchmark command, not a test): one
engine per setting, each given the same batch of prompts, then one step of each in turn until all have finished, so
every setting's steps run within milliseconds of the others' and a VM's slow and fast phases (its speed swings by
half over seconds) fall on all of them alike. `scripts/spec_bench.py` runs whole batches one after another; its A/A
spread is a few per cent, this one's about one.

    nice -n 10 python scripts/spec_lockstep.py --model golden/tiny-spec-dspark --settings plain,plain,auto,off
    python scripts/spec_lockstep.py --model golden/tiny-spec --settings plain,auto,always --repeats 30

Settings: `plain` (no draft head; give it twice for an A/A), `auto` / `always` (`--speculative-policy`), `off` (the
auto engine with its policy replaced by "never": what the off state costs). Columns: CPU ms per batch run (decode
steps only: each engine's first step, the prefill, is left out; one torch thread), the ratio of the sums against the
first plain setting, and the median of the repeats' ratios. Prompts: `golden/train_draft_heads.make_prompts` (half
pseudo-word text, half random ids), `--new` greedy tokens each, ignore-EOS.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
for p in (ROOT, ROOT / "scripts"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=ROOT / "golden" / "tiny-spec-dspark")
    p.add_argument("--settings", default="plain,plain,auto,off", help="comma-separated: plain, auto, always, off")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--k", type=int, default=2, help="MTP drafts (a DSpark head drafts its block)")
    p.add_argument("--input-len", type=int, default=40)
    p.add_argument("--new", type=int, default=32)
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--seed", type=int, default=20290)
    args = p.parse_args()
    settings = args.settings.split(",")
    if not settings or settings[0] != "plain" or any(s not in ("plain", "auto", "always", "off") for s in settings):
        p.error(f"--settings {args.settings!r}: plain first, then plain, auto, always or off")

    import torch

    torch.set_num_threads(1)
    from spec_bench import build_engine

    from engine.config import ModelConfig
    from engine.llm import SamplingParams
    from golden.train_draft_heads import make_prompts

    cfg = ModelConfig.from_json(args.model)
    method, k = ("dspark", cfg.dspark_block_size) if cfg.has_dspark else ("mtp", args.k)
    longest = args.input_len + args.new + k + 1
    engines = []
    for s in settings:
        if s == "plain":
            engines.append(build_engine(args.model, args.batch, longest, "none", 0, 1, "always"))
            continue
        eng = build_engine(args.model, args.batch, longest, method, k, 1, "always" if s == "always" else "auto")
        if s == "off":
            eng.spec_policy.speculate = lambda batch, seqs=(), waiting=False: False
        engines.append(eng)

    def run(prompts: list[list[int]]) -> list[float]:
        cpu = [0.0] * len(engines)
        for eng in engines:
            for ids in prompts:
                eng.add_request(ids, SamplingParams(temperature=0, max_tokens=args.new, ignore_eos=True))
        steps = [0] * len(engines)
        live, turn = list(range(len(engines))), 0
        while live:
            # each round starts from the next engine: the one stepped first (after another process's time slice,
            # or after a prefill) would otherwise always be the same setting
            turn += 1
            for i in live[turn % len(live):] + live[: turn % len(live)]:
                t = time.process_time()
                engines[i].step()
                if steps[i]:  # the first step is the prefill
                    cpu[i] += time.process_time() - t
                steps[i] += 1
                if not engines[i].has_unfinished():
                    live.remove(i)
        return cpu

    run(make_prompts(args.batch, args.seed - 1, (args.input_len, args.input_len)))  # warm-up, untimed
    runs = [run(make_prompts(args.batch, args.seed + 1000 * r, (args.input_len, args.input_len)))
            for r in range(args.repeats)]
    base = [r[0] for r in runs]
    print(f"{args.model.name}, batch {args.batch}, {method} k={k}, {args.repeats} repeats in lockstep")
    print("| setting | CPU ms / batch run | vs plain (sums) | vs plain (median of repeats) |")
    print("|---|---|---|---|")
    for i, s in enumerate(settings):
        mine = [r[i] for r in runs]
        median = statistics.median(b / m for b, m in zip(base, mine, strict=True))
        print(f"| {s}{' (A/A)' if s == 'plain' and i else ''} | {1e3 * statistics.fmean(mine):.1f} | "
              f"{sum(base) / sum(mine):.3f}x | {median:.3f}x |")


if __name__ == "__main__":
    main()
