"""Measure speculative decoding through the engine loop (a benchmark command, not a test): acceptance per draft
position, accepted / drafted, tokens per target step, and whether every output equals plain greedy.

    python golden/spec_acceptance.py                                   # golden/tiny-spec: MTP k = 1..4, DSpark
    python golden/spec_acceptance.py --model-dir golden/tiny --dspark-dir golden/tiny-dspark --ks 2
    python golden/spec_acceptance.py --ks 1,2,3 --new 32 --per-length 4   # 12 prompts (~5 min on the shared box)

Held-out prompts: `train_draft_heads.eval_prompts` (8 each of 7, 40 and 130 tokens, half pseudo-word text through
the tokenizer, half random ids; a seed the draft heads' training corpus does not use). Each prompt runs alone
(batch 1) through `engine.build(config)`'s LLMEngine with greedy sampling, `ignore_eos` and `--new` tokens: the
plain run first, then each speculative setting on a fresh engine, whose outputs must equal the plain ones token for
token. Numbers come from the engine itself: `LLMEngine.spec_stats` (engine/speculative.py SpecStats, vLLM's
spec_decode counters) and `LLMEngine.stats()` (steps, generated tokens). "tokens/step" = generated tokens /
engine steps over all prompts (the prefill step, which yields the first token, included); "decode tokens/step"
leaves the prefill step and its token out (1.0 without speculation).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

GOLDEN = Path(__file__).resolve().parent


def run_setting(model_dir: Path, prompts: list[list[int]], new: int, method: str = "none", k: int = 0) -> dict:
    """Every prompt alone through a fresh engine with `--speculative method --num-speculative-tokens k`."""
    import engine
    from engine.config import EngineConfig, Workload
    from engine.llm import SamplingParams

    longest = max(map(len, prompts)) + new
    cfg = EngineConfig.from_model_dir(model_dir, workload=Workload(max_num_seqs=1, max_model_len=longest,
                                                                   pool_tokens=longest,
                                                                   max_num_batched_tokens=longest),
                                      dtype="float32", speculative=method, num_speculative_tokens=k or None,
                                      speculative_policy="always")  # acceptance of every step, not only paying ones
    eng = engine.build(cfg)
    outs, t0 = [], time.perf_counter()
    for p in prompts:
        eng.add_request(p, SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True))
        while eng.has_unfinished():
            for o in eng.step():
                if o.finished:
                    outs.append(list(o.output_token_ids))
    st = eng.stats()
    row = {"method": method, "k": cfg.spec.num_speculative_tokens if method != "none" else 0,
           "seconds": round(time.perf_counter() - t0, 2), "steps": st.num_steps,
           "generated": st.num_generated_tokens, "tokens_per_step": st.num_generated_tokens / st.num_steps,
           "decode_tokens_per_step": (st.num_generated_tokens - len(prompts)) / (st.num_steps - len(prompts))}
    if method != "none":
        row.update(eng.spec_stats.to_dict())
    return {"row": row, "outputs": outs}


def measure(model_dir: Path, dspark_dir: Path | None, ks: list[int], new: int, seed: int,
            per_length: int = 8) -> list[dict]:
    from golden.train_draft_heads import eval_prompts

    prompts = [q for i, q in enumerate(eval_prompts(seed)) if i % 8 < per_length]  # 8 per length, in order
    plain = run_setting(model_dir, prompts, new)
    rows = [plain["row"]]
    settings = [(model_dir, "mtp", k) for k in ks] + ([(dspark_dir, "dspark", 0)] if dspark_dir else [])
    for d, method, k in settings:
        r = run_setting(d, prompts, new, method, k)
        same = [a == b for a, b in zip(r["outputs"], plain["outputs"], strict=True)]
        r["row"]["identical_to_plain"] = f"{sum(same)}/{len(same)}"
        rows.append(r["row"])
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-dir", type=Path, default=GOLDEN / "tiny-spec")
    p.add_argument("--dspark-dir", type=Path, default=GOLDEN / "tiny-spec-dspark", help="'' to skip DSpark")
    p.add_argument("--ks", default="1,2,3,4", help="MTP drafts per step to measure")
    p.add_argument("--new", type=int, default=64, help="tokens generated per prompt")
    p.add_argument("--seed", type=int, default=20271, help="eval_prompts seed (train_draft_heads: SEED + 1)")
    p.add_argument("--per-length", type=int, default=8, help="prompts of each length (7, 40, 130) to run, <= 8")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", type=Path, help="also write the rows here")
    args = p.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    dspark = args.dspark_dir if args.dspark_dir and str(args.dspark_dir) not in ("", ".") else None
    rows = measure(args.model_dir, dspark, [int(k) for k in args.ks.split(",") if k], args.new, args.seed,
                   args.per_length)
    for r in rows:
        pos = r.get("acceptance_rate_per_position")
        print(f"{r['method']:>6} k={r['k']}: tokens/step {r['tokens_per_step']:.3f} (decode "
              f"{r['decode_tokens_per_step']:.3f}), {r['steps']} steps for {r['generated']} tokens"
              + (f", accepted {r['num_accepted_tokens']}/{r['num_draft_tokens']} = {r['acceptance_rate']:.3f}, "
                 f"per position {[round(x, 3) for x in pos]}, identical to plain {r['identical_to_plain']}"
                 if pos is not None else ""))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
