"""The floors behind deepinfer_bench/bench/golden.py OFFICIAL_TOL: how close other valid implementations of the official
numerics come to the official goldens, teacher-forced on the goldens' tokens (456 steps).

    python scripts/official_floors.py --official-src DeepSeek-V4-Pro-code/inference   # ~10 min, 1 thread

Rows (top-1 agreement with the golden's tokens, worst prompt, max |dlogit|):
* bf16, official code, rsqrt rounded once + fp64 sums: the official model.py (golden/official_kernels.py CPU
  kernels, GEMMs and attention summed in fp64) with torch.rsqrt of bf16 tensors rounded once from fp64, as a GPU
  rounds it (torch's CPU kernel rounds twice, bf16(1 / bf16(sqrt x)), past the last 32-wide vector chunk: the
  golden carries that), against golden/official;
* fp32, official code, fp64 sums: against golden/official-fp32;
* the engine with hf numerics (no simulation) against each golden: what the check must tell apart.
Get the official code as golden/README.md says (fetched, never vendored).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from deepinfer_bench.bench.golden import forced_with_logits, golden_config, load_golden  # noqa: E402
from engine.config import ModelConfig  # noqa: E402
from golden import make_official_golden as mog  # noqa: E402
from golden import official_kernels  # noqa: E402

MODEL = ROOT / "golden" / "tiny-official"
GOLDEN = {torch.bfloat16: ROOT / "golden" / "official", torch.float32: ROOT / "golden" / "official-fp32"}


def score(prompts, logits: dict[str, torch.Tensor]) -> str:
    agree = total = 0
    worst, dmax = (1.0, ""), 0.0
    for p in prompts:
        n = len(p.output_ids)
        hit = int((logits[p.name][:n].argmax(-1) == torch.tensor(p.output_ids)).sum())
        agree, total = agree + hit, total + n
        worst = min(worst, (hit / n, f"{p.name} {hit}/{n}"))
        dmax = max(dmax, float((logits[p.name][:n] - p.logits[:n]).abs().max()))
    return f"{agree}/{total} = {agree / total:.1%}, worst prompt {worst[1]}, max |dlogit| {dmax:.2f}"


def official_floor(module, dtype: torch.dtype, prompts) -> str:
    forced = {p.name: p.output_ids for p in prompts}
    rsqrt = torch.rsqrt

    def once(x, *a, **k):  # a GPU's bf16 rsqrt: computed wide, rounded once
        return rsqrt(x.double()).to(x.dtype) if x.dtype == torch.bfloat16 else rsqrt(x, *a, **k)

    torch.rsqrt = once
    try:
        res, _ = mog.run_official(module, MODEL, dtype, official_kernels.Simulation(fp64_accum=True), forced)
    finally:
        torch.rsqrt = rsqrt
    return score(prompts, {k: v[1] for k, v in res.items()})


def engine_hf(dtype: torch.dtype, prompts) -> str:
    from engine import build

    name = "bfloat16" if dtype == torch.bfloat16 else "float32"
    config = golden_config(model_dir=MODEL, golden_dir=GOLDEN[dtype], numerics="hf", dtype=name)
    _, logits = forced_with_logits(build(config), [p.prompt_ids for p in prompts], [p.output_ids for p in prompts])
    return score(prompts, {p.name: lg for p, lg in zip(prompts, logits, strict=True)})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--official-src", type=Path, required=True, help="the official inference/ folder")
    args = ap.parse_args()
    torch.set_num_threads(1)
    module = mog.load_official(args.official_src)
    cfg = ModelConfig.from_json(MODEL)
    for dtype in (torch.bfloat16, torch.float32):
        _, prompts = load_golden(GOLDEN[dtype], cfg)
        print(f"{dtype}: official code, {'rsqrt rounded once + ' if dtype == torch.bfloat16 else ''}fp64 sums: "
              f"{official_floor(module, dtype, prompts)}", flush=True)
        print(f"{dtype}: engine, hf numerics: {engine_hf(dtype, prompts)}", flush=True)


if __name__ == "__main__":
    main()
