"""`deepinfer reference` (library: deepinfer_bench/bench/refcache.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from deepinfer_bench.bench.report import err_console
from deepinfer_bench.cli.app import app


@app.command("reference")
def reference_cmd(
    model_dir: Annotated[Path, typer.Option(help="The model (official or HF checkpoint dir) the reference is of.")],
    out: Annotated[Path, typer.Option(help="Reference cache dir to write (content-addressed; `deepinfer golden "
                                           "--reference DIR` reads it).")],
    golden_dir: Annotated[Path | None, typer.Option(help="Golden whose token sequences are scored (default: "
                                                         "golden/).")] = None,
    per_layer: Annotated[list[str] | None, typer.Option(
        "--per-layer", help="Golden prompt whose every layer is captured too; repeatable.")] = None,
) -> None:
    """Make a model's HF reference logits once, for hosts without transformers.

    On a CPU box with transformers: fp32 logits and the bf16 draws of the noise band teacher-forced on the golden's
    token sequences (and per-layer captures with the KV state), stored content-addressed in --out. A trn2 host
    without transformers then runs `deepinfer golden --model-dir D --dtype bfloat16 --reference DIR`."""
    from deepinfer_bench.bench.golden import GOLDEN_DIR, load_golden
    from deepinfer_bench.bench.refcache import Sequence, get_reference
    from engine.config import ModelConfig

    cfg = ModelConfig.from_json(model_dir)
    golden_dir = golden_dir or GOLDEN_DIR
    _, prompts = load_golden(golden_dir, cfg, check_model=False)
    names = [p.name for p in prompts]
    unknown = [n for n in per_layer or [] if n not in names]
    if unknown:
        raise typer.BadParameter(f"--per-layer {unknown}: not in {golden_dir}; it has {names}")
    seqs = [Sequence(p.name, p.prompt_ids, p.output_ids) for p in prompts]
    ref = get_reference(model_dir, cfg, seqs, per_layer=per_layer or [], cache_dir=out)
    err_console.print(f"[green]reference {ref.key}[/green]: {len(seqs)} sequences, fp32 + "
                      f"{sum(k.startswith('bfloat16') for k in ref.logits)} bf16 draws of logits"
                      f"{', per-layer ' + ', '.join(per_layer) if per_layer else ''}  ->  {out / ref.key}")
