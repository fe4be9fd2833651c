"""`deepinfer golden` and `deepinfer generate`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from deepinfer_bench.app import app
from deepinfer_bench.report import DEFAULT_MODEL_DIR, DEFAULT_OUT_DIR, err_console, render_df, save_results

ModelDir = Annotated[Path, typer.Option("--model-dir", help="DeepSeek-V4 dir: config.json + safetensors (official or "
                                                           "HF names). Default: the embedded tiny model.")]
Cp = Annotated[int, typer.Option("--cp", min=1, help="Context/expert-parallel ranks (launched as processes here).")]


@app.command("golden")
def golden_cmd(
    model_dir: ModelDir = DEFAULT_MODEL_DIR,
    golden_dir: Annotated[Path | None, typer.Option(help="Golden data dir (default: golden/).")] = None,
    dtype: Annotated[str, typer.Option(help="float32 (exact check) or bfloat16 (looser, documented tolerance).")] = (
        "float32"),
    cp: Cp = 1,
    prefill_chunk: Annotated[int | None, typer.Option(help="Prefill in chunks of N tokens per sequence.")] = None,
    report_collectives: Annotated[bool, typer.Option(help="Print collective calls per layer per step.")] = False,
    out: Annotated[Path, typer.Option(help="Results folder (a new run dir each time).")] = DEFAULT_OUT_DIR,
) -> None:
    """Run every golden prompt as one batch through the engine and compare with the HF reference outputs."""
    from deepinfer_bench.golden import collectives_per_layer, run_golden

    if dtype not in ("float32", "bfloat16"):
        raise typer.BadParameter(f"--dtype {dtype!r}: expected float32 or bfloat16")
    err_console.print(f"[dim]golden: model {model_dir}, dtype {dtype}, cp {cp}"
                      + (f", prefill chunks of {prefill_chunk}" if prefill_chunk else "") + "[/dim]")
    run = run_golden(model_dir, golden_dir, dtype=dtype, cp=cp, prefill_chunk=prefill_chunk)
    render_df(run.table, f"golden vs HF reference ({dtype}, cp={cp})")
    if run.collectives and (report_collectives or cp > 1):
        render_df(collectives_per_layer(run.collectives, run.steps), f"collectives per layer per step "
                                                                      f"({run.steps} engine steps)")
    path = save_results(run.table, out, "golden", run.meta)
    n = len(run.table)
    style = "green" if run.ok else "red"
    toks = f"{int(run.table['tokens_matched'].sum())}/{int(run.table['tokens_total'].sum())}"
    err_console.print(f"[{style}]{run.n_match}/{n} prompts match[/{style}] (greedy tokens identical: {toks}, "
                      f"max |dlogit| {run.table['max_abs_dlogit'].max():.2e}, tol {run.table['logit_tol'].iloc[0]})"
                      f"  ->  {path}")
    raise typer.Exit(0 if run.ok else 1)


@app.command("generate")
def generate_cmd(
    model_dir: ModelDir = DEFAULT_MODEL_DIR,
    prompt: Annotated[str | None, typer.Option(help="Text prompt (needs a tokenizer in the model dir).")] = None,
    prompt_ids: Annotated[str | None, typer.Option(help="Comma-separated token ids, e.g. 1,2,3.")] = None,
    max_tokens: Annotated[int, typer.Option(min=1)] = 32,
    temperature: Annotated[float, typer.Option(min=0.0, help="0 = greedy.")] = 0.0,
    top_p: Annotated[float, typer.Option()] = 1.0,
    top_k: Annotated[int, typer.Option()] = 0,
    seed: Annotated[int | None, typer.Option()] = None,
    dtype: Annotated[str, typer.Option()] = "float32",
    cp: Cp = 1,
    as_json: Annotated[bool, typer.Option("--json", help="Print {prompt_ids, output_ids, text} as JSON.")] = False,
) -> None:
    """One-off generation through the full engine (scheduler, KV pool, sampler)."""
    from deepinfer_bench.generate import generate

    if (prompt is None) == (prompt_ids is None):
        raise typer.BadParameter("give exactly one of --prompt or --prompt-ids")
    ids = None
    if prompt_ids is not None:
        try:
            ids = [int(x) for x in prompt_ids.split(",") if x.strip()]
        except ValueError:
            raise typer.BadParameter(f"--prompt-ids {prompt_ids!r}: expected comma-separated integers") from None
    result = generate(model_dir, prompt=prompt, prompt_ids=ids, max_tokens=max_tokens, temperature=temperature,
                      top_p=top_p, top_k=top_k, seed=seed, dtype=dtype, cp=cp)
    if as_json:
        typer.echo(json.dumps(result))
    else:
        typer.echo(result["text"] if result["text"] is not None else " ".join(map(str, result["output_ids"])))
