"""`deepinfer golden`: every golden prompt, as one batch, through the full engine, against the independent HF
reference outputs in golden/ (golden/make_golden.py). Returns data; the CLI renders it."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from deepinfer_bench.report import REPO_ROOT
from engine.config import ModelConfig
from engine.parallel import Parallel

GOLDEN_DIR = REPO_ROOT / "golden"
MAGIC, FORMAT_VERSION = "deepinfer-golden", 1
REGENERATE = "pip install -e '.[reference]' && python golden/make_golden.py"
# fp32 must match the fp32 HF reference to ~1e-5; 1e-3 leaves room for summation order, nothing more.
FP32_LOGIT_TOL = 1e-3
# bf16 vs the fp32 reference: bf16 has 8 mantissa bits and the residual streams are re-rounded at every mHC site, so
# logits move by O(1) on the tiny model (|logit| up to ~13). Calibration: HF's own bf16 run of the same weights
# deviates from its fp32 run by 1.5-2.9 on the first six golden prompts (measured 2026-12-02, transformers 5.24), so
# the bf16 tolerance is 3.0. A greedy divergence only counts as agreement when the reference's own top-2 margin at
# that step is within the tolerance (a near tie that bf16 may legitimately flip).
BF16_LOGIT_TOL = 3.0

COLUMNS = ["prompt", "kind", "prompt_len", "tokens_matched", "tokens_total", "first_divergent_step",
           "max_abs_dlogit", "logit_tol", "verdict"]


class GoldenError(RuntimeError):
    """Golden data missing, of another format, or made for another model."""


@dataclass
class GoldenPrompt:
    name: str
    kind: str
    prompt_ids: list[int]
    output_ids: list[int]
    logits: torch.Tensor  # [N, vocab] fp32


@dataclass
class GoldenRun:
    table: pd.DataFrame
    meta: dict[str, Any]
    collectives: dict[str, int] = field(default_factory=dict)
    steps: int = 0

    @property
    def n_match(self) -> int:
        return int((self.table["verdict"] == "match").sum())

    @property
    def ok(self) -> bool:
        return self.n_match == len(self.table)


def load_golden(golden_dir: Path, cfg: ModelConfig) -> tuple[dict[str, Any], list[GoldenPrompt]]:
    from safetensors.torch import load_file

    meta_path, data_path = golden_dir / "golden.json", golden_dir / "golden.safetensors"
    if not meta_path.exists() or not data_path.exists():
        raise GoldenError(f"no golden data in {golden_dir} (expected golden.json + golden.safetensors); "
                          f"regenerate with: {REGENERATE}")
    meta = json.loads(meta_path.read_text())
    if meta.get("magic") != MAGIC or meta.get("format_version") != FORMAT_VERSION:
        raise GoldenError(f"{meta_path}: format {meta.get('magic')!r} v{meta.get('format_version')}, this deepinfer "
                          f"reads {MAGIC!r} v{FORMAT_VERSION}; regenerate with: {REGENERATE}")
    if meta.get("config_hash") != cfg.config_hash():
        raise GoldenError(f"{meta_path} was made for config {meta.get('config_hash')}, the model's config is "
                          f"{cfg.config_hash()}; regenerate with: {REGENERATE}")
    tensors = load_file(str(data_path))
    prompts = [GoldenPrompt(name=p["name"], kind=p["kind"], prompt_ids=tensors[f"{p['name']}.prompt_ids"].tolist(),
                            output_ids=tensors[f"{p['name']}.output_ids"].tolist(),
                            logits=tensors[f"{p['name']}.logits"].float()) for p in meta["prompts"]]
    return meta, prompts


def _golden_job(par: Parallel, model_dir: str, dtype: str, prompts: list[list[int]], max_new: int,
                prefill_chunk: int | None) -> tuple[list[list[int]], list[torch.Tensor], dict[str, int], int, str, int]:
    from engine.runner import ModelRunner, RunnerConfig, default_block_size, greedy_generate

    cfg = ModelConfig.from_json(Path(model_dir))
    bs = default_block_size(cfg, par.cp)
    blocks = sum(-(-(len(p) + max_new) // bs) for p in prompts)
    rc = RunnerConfig(max_num_seqs=len(prompts), num_kv_blocks=blocks, block_size=bs,
                      max_model_len=max(len(p) for p in prompts) + max_new, dtype=dtype)
    runner = ModelRunner.from_model_dir(model_dir, rc, par)
    outs, logits = greedy_generate(runner, prompts, max_new, prefill_chunk=prefill_chunk)
    launches = runner.regions.launches if runner.regions is not None else 0
    return outs, logits, par.report(), runner.num_steps, runner.graph_mode, launches


def compare(g: GoldenPrompt, out: list[int], logits: torch.Tensor, dtype: str) -> dict[str, Any]:
    n = len(g.output_ids)
    out, logits = out[:n], logits[:n]
    diverge = next((i for i, (a, b) in enumerate(zip(out, g.output_ids, strict=True)) if a != b), None)
    upto = n if diverge is None else diverge + 1  # logits are comparable up to and including the divergent step
    dlogit = float((logits[:upto] - g.logits[:upto]).abs().max())
    tol = FP32_LOGIT_TOL if dtype == "float32" else BF16_LOGIT_TOL
    matched = sum(a == b for a, b in zip(out, g.output_ids, strict=True))
    if diverge is None:
        verdict = "match" if dlogit <= tol else "mismatch"
    elif dtype != "float32" and dlogit <= tol:
        top2 = g.logits[diverge].topk(2).values
        verdict = "match" if float(top2[0] - top2[1]) <= tol else "mismatch"
    else:
        verdict = "mismatch"
    return {"prompt": g.name, "kind": g.kind, "prompt_len": len(g.prompt_ids), "tokens_matched": matched,
            "tokens_total": n, "first_divergent_step": -1 if diverge is None else diverge,
            "max_abs_dlogit": dlogit, "logit_tol": tol, "verdict": verdict}


def run_golden(model_dir: str | Path | None = None, golden_dir: str | Path | None = None, dtype: str = "float32",
               cp: int = 1, prefill_chunk: int | None = None) -> GoldenRun:
    """All golden prompts as one batch (prefill + decode) through the engine on `cp` ranks; one row per prompt."""
    from engine.launch import effective_cp, run_spmd
    from engine.parallel import check_layout

    model_dir = Path(model_dir or GOLDEN_DIR / "tiny")
    golden_dir = Path(golden_dir or GOLDEN_DIR)
    cfg = ModelConfig.from_json(model_dir)
    cp = effective_cp(cp)
    check_layout(cfg, cp)
    meta, prompts = load_golden(golden_dir, cfg)
    max_new = max(len(p.output_ids) for p in prompts)
    job_args = (str(model_dir), dtype, [p.prompt_ids for p in prompts], max_new, prefill_chunk)
    outs, logits, coll, steps, graph_mode, launches = run_spmd(_golden_job, cp, job_args)
    rows = [compare(p, o, lg, dtype) for p, o, lg in zip(prompts, outs, logits, strict=True)]
    run_meta = {"model_dir": str(model_dir), "golden_dir": str(golden_dir), "dtype": dtype, "cp": cp,
                "prefill_chunk": prefill_chunk, "config_hash": cfg.config_hash(),
                "golden": {k: meta.get(k) for k in ("seed", "torch_version", "transformers_version", "reference")},
                "engine_steps": steps, "graph_mode": graph_mode, "region_launches": launches, "collectives": coll}
    return GoldenRun(table=pd.DataFrame(rows, columns=COLUMNS), meta=run_meta, collectives=coll, steps=steps)


def collectives_per_layer(coll: dict[str, int], steps: int) -> pd.DataFrame:
    """Collective calls per layer per engine step, one column per site (e.g. moe.exchange:all_gather)."""
    rows: dict[str, dict[str, float]] = {}
    for key, count in coll.items():
        layer, site = key.split(".", 1)
        rows.setdefault(layer, {"layer": int(layer[1:])})[site] = count / max(1, steps)
    df = pd.DataFrame(sorted(rows.values(), key=lambda r: r["layer"]))
    return df.fillna(0.0)

