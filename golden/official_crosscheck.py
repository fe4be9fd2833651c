"""The official inference code vs the HF reference on golden/tiny-official.

    python golden/official_crosscheck.py --official-src DIR   # writes golden/official/crosscheck.json (~25 min)


1. Free-running, simulation off, fp32: the official code (with golden/official_kernels.py) and HF fp32 each decode
   every golden prompt greedily; tokens must agree and logits to ~1e-5. This validates the CPU kernels: with the
   simulation off the official forward and HF's are the same math.
2. Teacher-forced on the official golden's tokens: the official code in fp32 / bf16 with each simulation step alone
   and all of them, against HF fp32 on the same sequences: max |dlogit| and top-1 agreement. How far the official
   numerics move the logits, step by step. The last variant (GEMMs and attention accumulated in fp64, every
   rounding point unchanged) measures how much an equally valid implementation of the official numerics moves
   away from the golden: the floor under any engine's tolerance.
3. The same floor for the fp32 staging golden (golden/official-fp32): fp64 accumulation against the fp32 run.

Writes `crosscheck.json` next to the golden (the numbers golden/README.md quotes).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

if __package__ in (None, ""):  # run as a script: the repo root on the path, like make_official_golden.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.config import ModelConfig  # noqa: E402
from golden.make_official_golden import (  # noqa: E402
    HOW_TO_GET,
    MODEL_DIR,
    OUT_DIR,
    golden_prompts,
    load_official,
    run_official,  # noqa: E402
)
from golden.official_kernels import Simulation  # noqa: E402

OFF = Simulation(act=False, kv_fp8=False, indexer_fp4=False)
ALL = Simulation()
VARIANTS = (
    ("fp32, no simulation", torch.float32, OFF),
    ("fp32, activation quant only", torch.float32, Simulation(act=True, kv_fp8=False, indexer_fp4=False)),
    ("fp32, KV FP8 only", torch.float32, Simulation(act=False, kv_fp8=True, indexer_fp4=False)),
    ("fp32, indexer Hadamard+FP4 only", torch.float32, Simulation(act=False, kv_fp8=False, indexer_fp4=True)),
    ("fp32, all simulation", torch.float32, ALL),
    ("bf16, no simulation", torch.bfloat16, OFF),
    ("bf16, all simulation (= the golden)", torch.bfloat16, ALL),
    ("bf16, all simulation, fp64 accumulation", torch.bfloat16, Simulation(fp64_accum=True)),
)


def _hf(model_dir: Path, cfg: ModelConfig):
    from deepinfer_bench.bench.hf_reference import build_hf_model
    from engine.loader import load_checkpoint

    return build_hf_model(cfg, load_checkpoint(model_dir, cfg, dtype=torch.float32), dtype=torch.float32)


@torch.no_grad()
def _hf_forced(hf, ids: list[int], tokens: list[int]) -> torch.Tensor:
    """HF fp32 logits for each of `tokens` given the prompt and the tokens before it (one full forward)."""
    seq = torch.tensor([ids + tokens[:-1]])
    return hf(input_ids=seq).logits[0, len(ids) - 1:].float()


def _compare(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict:
    dl = max(float((a[n] - b[n]).abs().max()) for n in a)
    agree = sum(int((a[n].argmax(-1) == b[n].argmax(-1)).sum()) for n in a)
    total = sum(a[n].shape[0] for n in a)
    per_prompt = {n: round(float((a[n] - b[n]).abs().max()), 6) for n in a}
    return {"max_abs_dlogit": dl, "top1_agree": agree, "steps": total, "per_prompt_max_abs_dlogit": per_prompt}


def cross_check(module, model_dir: Path, out_dir: Path) -> dict:
    from deepinfer_bench.bench.hf_reference import hf_greedy

    cfg = ModelConfig.from_json(Path(model_dir) / "config.json")
    hf = _hf(model_dir, cfg)
    prompts = golden_prompts(model_dir, cfg)
    root = Path(__file__).resolve().parent.parent
    where = Path(model_dir).resolve()
    shown = str(where.relative_to(root)) if where.is_relative_to(root) else str(model_dir)
    report: dict = {"model_dir": shown, "free_running_fp32_no_simulation": {}, "teacher_forced": {}}

    # 1. free-running, fp32, simulation off
    official, _ = run_official(module, model_dir, torch.float32, OFF)
    same, dl = 0, 0.0
    for name, _, _, max_new, ids in prompts:
        toks, logits = official[name]
        hf_toks, hf_logits = hf_greedy(hf, ids, max_new)
        same += toks == hf_toks
        div = next((i for i, (x, y) in enumerate(zip(toks, hf_toks, strict=True)) if x != y), max_new)
        dl = max(dl, float((logits[: div + 1] - hf_logits[: div + 1]).abs().max()))
    report["free_running_fp32_no_simulation"] = {"prompts_identical": same, "prompts": len(prompts),
                                                 "max_abs_dlogit": dl}
    print(f"free-running fp32, simulation off: {same}/{len(prompts)} prompts with identical greedy tokens, "
          f"max |dlogit| vs HF fp32 {dl:.2e}", flush=True)

    # 2. teacher-forced on the official golden's tokens
    golden, _ = run_official(module, model_dir)  # bf16, all simulation: the golden itself
    forced = {name: golden[name][0] for name, *_ in prompts}
    hf_logits = {name: _hf_forced(hf, ids, forced[name]) for name, _, _, _, ids in prompts}
    gold_logits = {name: golden[name][1] for name in forced}
    for label, dtype, sim in VARIANTS:
        res, watch = run_official(module, model_dir, dtype, sim, forced)
        logits = {name: res[name][1] for name in forced}
        row = {"vs_hf_fp32": _compare(logits, hf_logits), "vs_golden": _compare(logits, gold_logits),
               "topk_boundary_ties": watch.ties, "topk_rows": watch.rows}
        report["teacher_forced"][label] = row
        h, gd = row["vs_hf_fp32"], row["vs_golden"]
        print(f"{label:>38}: vs HF fp32 max |dlogit| {h['max_abs_dlogit']:.3e}, top-1 {h['top1_agree']}/"
              f"{h['steps']}; vs golden max |dlogit| {gd['max_abs_dlogit']:.3e}, top-1 {gd['top1_agree']}/"
              f"{gd['steps']}; indexer top-k ties {watch.ties['indexer']}/{watch.rows['indexer']}", flush=True)

    # 3. the same floor for the fp32 staging golden (golden/official-fp32): fp64 accumulation vs fp32, on its tokens
    fp32_run, _ = run_official(module, model_dir, torch.float32, ALL)
    forced32 = {name: fp32_run[name][0] for name in forced}
    res, _ = run_official(module, model_dir, torch.float32, Simulation(fp64_accum=True), forced32)
    row = _compare({n: res[n][1] for n in forced32}, {n: fp32_run[n][1] for n in forced32})
    report["fp32_all_simulation_fp64_accumulation_vs_fp32_golden"] = row
    print(f"fp32 all simulation, fp64 accumulation vs the fp32 staging golden: max |dlogit| "
          f"{row['max_abs_dlogit']:.3e}, top-1 {row['top1_agree']}/{row['steps']}, per prompt "
          f"{row['per_prompt_max_abs_dlogit']}", flush=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "crosscheck.json").write_text(json.dumps(report, indent=1) + "\n")
    return report


def main() -> None:
    p = argparse.ArgumentParser(description="The official code (simulation off / on, fp32 / bf16) vs HF fp32 on "
                                "golden/tiny-official; writes crosscheck.json.")
    p.add_argument("--official-src", type=Path, required=True, help=f"the official inference/ folder ({HOW_TO_GET})")
    p.add_argument("--model-dir", type=Path, default=MODEL_DIR)
    p.add_argument("--out", type=Path, default=OUT_DIR)
    args = p.parse_args()
    from engine.backends.host import setup_host_process

    setup_host_process(threads=1)  # as make_official_golden.py: MKL's reproducible mode, one thread
    cross_check(load_official(args.official_src), args.model_dir, args.out)


if __name__ == "__main__":
    main()
