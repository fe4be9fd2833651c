"""How far the independent HF reference's OWN bf16 run lands from its fp32 golden logits, per golden prompt: the
yardstick of `deepinfer golden --dtype bfloat16`'s tolerance (deepinfer_bench/bench/golden.py BF16_LOGIT_TOL).

    python scripts/calibrate_bf16_tol.py     # needs the `reference` extra; ~1 min on 2 cores

Teacher-forced: HF bf16 runs prompt + golden output (one forward, no cache) and its logits at the output positions
are compared with the golden fp32 ones, so every step is compared on the same prefix."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from deepinfer_bench.bench.golden import GOLDEN_DIR, load_golden  # noqa: E402
from deepinfer_bench.bench.hf_reference import build_hf_model  # noqa: E402
from engine.config import ModelConfig  # noqa: E402
from engine.loader import load_checkpoint  # noqa: E402


def main() -> None:
    cfg = ModelConfig.from_json(GOLDEN_DIR / "tiny")
    _, prompts = load_golden(GOLDEN_DIR, cfg)
    state = load_checkpoint(GOLDEN_DIR / "tiny", cfg, dtype=torch.float32, include_mtp=False)
    hf = build_hf_model(cfg, state, dtype=torch.bfloat16)
    worst = 0.0
    for p in prompts:
        ids = torch.tensor([p.prompt_ids + p.output_ids[:-1]])
        with torch.no_grad():
            out = hf(input_ids=ids, use_cache=False).logits[0].float()  # [P + N - 1, V]
        got = out[len(p.prompt_ids) - 1:]
        d = float((got - p.logits).abs().max())
        worst = max(worst, d)
        print(f"{p.name:14s} prompt {len(p.prompt_ids):4d}  HF bf16 vs HF fp32 max |dlogit| {d:.3f}")
    print(f"worst {worst:.3f}")


if __name__ == "__main__":
    main()
