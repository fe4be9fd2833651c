#!/usr/bin/env python
"""TTFT of a request whose prompt shares a cached prefix, against the request that cached it (a benchmark, not a
test): issue 44's target is second / first <= 0.2 for a 2,048-token prefix and a 32-token new suffix.

    nice -n 10 python scripts/prefix_cache_bench.py                              # golden/bench/mid, 2048 + 32
    python scripts/prefix_cache_bench.py --model-dir golden/tiny --prefix-len 256 --repeats 1

Per repeat (a fresh random prefix each, so the first request is always a miss): on an engine with prefix caching,
request 1 = prefix + suffix A, then request 2 = prefix + suffix B (the hit); on an engine without it, request 2's
prompt again (what the hit saves). Requests run one at a time through `LLMEngine.step`; TTFT = arrival to first
token, in-process (no server). Printed: every repeat's TTFTs, the median ratio and the prefix_cache counters.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def build_engine(model_dir: Path, longest: int, budget: int, dtype: str, cached: bool, threads: int | None):
    import engine
    from engine.config import EngineConfig, Workload

    # room for the cached prefix and the next request beside it
    work = Workload(max_num_seqs=1, max_model_len=longest, max_num_batched_tokens=budget, pool_tokens=3 * longest)
    cfg = EngineConfig.from_model_dir(model_dir, workload=work, dtype=dtype, enable_prefix_caching=cached)
    return engine.build(cfg, threads=threads)


def ttft(eng, prompt: list[int], new: int) -> float:
    """Seconds from arrival to the first token of one greedy request (run to the end, so the next starts clean)."""
    from engine.sampler import SamplingParams

    rid = eng.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True),
                          arrival_time=time.perf_counter())
    first = None
    while eng.has_unfinished():
        for o in eng.step():
            if o.request_id == rid and first is None and o.first_token_time is not None:
                first = o.first_token_time - o.arrival_time
    return first


def measure(model_dir: Path, prefix_len: int = 2048, suffix_len: int = 32, new: int = 2, repeats: int = 3,
            budget: int = 2048, dtype: str = "bfloat16", threads: int | None = None) -> dict:
    """The TTFTs per repeat, printed as they come, and their median hit / first ratio (and the engine's counters)."""
    import torch

    from engine.config import ModelConfig

    if not (model_dir / "config.json").exists():
        sys.exit(f"error: {model_dir} has no config.json (make it: python golden/make_bench_model.py --preset mid)")
    vocab = ModelConfig.from_json(model_dir).vocab_size
    longest = prefix_len + suffix_len + new
    on = build_engine(model_dir, longest, budget, dtype, True, threads)
    off = build_engine(model_dir, longest, budget, dtype, False, threads)
    rows = []
    g = torch.Generator().manual_seed(44)

    def ids(n: int) -> list[int]:
        return torch.randint(2, min(vocab, 1024), (n,), generator=g).tolist()

    ttft(on, ids(suffix_len), new)  # warm-up (first-call allocations)
    ttft(off, ids(suffix_len), new)
    print(f"{model_dir.name}: prefix {prefix_len} + suffix {suffix_len}, dtype {dtype}, "
          f"budget {budget} tokens/step, kernels {on.config.kernels.value}")
    print(f"{'repeat':>6} {'first (miss) s':>15} {'second (hit) s':>15} {'no cache s':>11} {'hit/first':>10}")
    for r in range(repeats):
        prefix = ids(prefix_len)
        first = ttft(on, prefix + ids(suffix_len), new)
        hits0 = on.stats().prefix_cache_hits
        second_prompt = prefix + ids(suffix_len)
        second = ttft(on, second_prompt, new)
        hit = on.stats().prefix_cache_hits - hits0
        plain = ttft(off, second_prompt, new)
        rows.append({"first_s": first, "second_s": second, "no_cache_s": plain, "hit_tokens": hit})
        print(f"{r:>6} {first:>15.3f} {second:>15.3f} {plain:>11.3f} {second / first:>10.3f}   ({hit} tokens hit)")
    ratio = statistics.median(x["second_s"] / x["first_s"] for x in rows)
    s = on.stats()
    print(f"median hit/first TTFT: {ratio:.3f} (target <= 0.2: {'met' if ratio <= 0.2 else 'NOT met'}); "
          f"vllm:prefix_cache_queries {s.prefix_cache_queries}, vllm:prefix_cache_hits {s.prefix_cache_hits}")
    return {"model_dir": str(model_dir), "prefix_len": prefix_len, "suffix_len": suffix_len, "dtype": dtype,
            "runs": rows, "median_ratio": ratio}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model-dir", type=Path, default=ROOT / "golden" / "bench" / "mid")
    p.add_argument("--prefix-len", type=int, default=2048)
    p.add_argument("--suffix-len", type=int, default=32)
    p.add_argument("--new", type=int, default=2, help="tokens generated per request")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--json", type=Path, default=None, help="also write the numbers here")
    a = p.parse_args()
    out = measure(a.model_dir, a.prefix_len, a.suffix_len, a.new, a.repeats, a.max_num_batched_tokens, a.dtype,
                  a.threads)
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
