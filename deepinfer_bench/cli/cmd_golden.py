"""`deepinfer golden` (library: deepinfer_bench/bench/golden.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from deepinfer_bench.bench.report import DEFAULT_OUT_DIR, err_console, render_df, save_results
from deepinfer_bench.cli.app import app
from deepinfer_bench.cli.options import EngineArgs, engine_options


@app.command("golden")
@engine_options
def golden_cmd(
    engine: EngineArgs,
    golden_dir: Annotated[Path | None, typer.Option(help="Golden data dir (default: golden/).")] = None,
    report_collectives: Annotated[bool, typer.Option(help="Print collective calls per layer per step.")] = False,
    out: Annotated[Path, typer.Option(help="Results folder (a new run dir each time).")] = DEFAULT_OUT_DIR,
) -> None:
    """Check the engine's tokens and logits against the independent reference goldens.

    Runs every golden prompt through the engine's serving path (scheduler, KV pool, greedy sampler; on --cp
    ranks) and compares tokens and logits with the HF reference outputs. Exit 1 on any mismatch. With --numerics
    official: golden/tiny-official against DeepSeek's own inference code (golden/official, or golden/official-fp32
    for --dtype float32), teacher-forced, by the statistical bounds of deepinfer_bench/bench/golden.py OFFICIAL_TOL."""
    import dataclasses

    from deepinfer_bench.bench.golden import collectives_per_layer, default_dirs, load_golden, run_golden, workload
    from deepinfer_bench.bench.report import DEFAULT_MODEL_DIR

    model_dir, default_golden = default_dirs(engine.numerics or "hf", engine.dtype or "float32")
    if engine.model_dir == DEFAULT_MODEL_DIR:  # not given: the numerics' own tiny model
        engine = dataclasses.replace(engine, model_dir=model_dir)
    cfg = engine.model_config()
    golden_dir = golden_dir or default_golden
    _, prompts = load_golden(golden_dir, cfg)
    config = engine.config(cfg, workload=workload(prompts))
    c = config.cache
    err_console.print(f"[dim]golden: model {engine.model_dir}, {config.model.dtype}, cp {config.cp}, backend "
                      f"{config.backend}, graph {config.graph.mode}, kernels {config.kernels}, weights "
                      f"{config.model.weights}; max_num_seqs "
                      f"{c.max_num_seqs}, max_num_batched_tokens {c.max_num_batched_tokens}, num_kv_blocks "
                      f"{c.num_kv_blocks} x {c.block_size}[/dim]")
    if str(config.backend) != "host":
        from engine.backends import measured_on

        err_console.print(f"[dim]measured on: {measured_on(config.backend)}[/dim]")
    run = run_golden(config, golden_dir, progress=True)
    ref = "the official code, teacher-forced" if str(config.model.numerics) == "official" else "HF reference"
    render_df(run.table, f"golden vs {ref} ({config.model.dtype}, cp={config.cp}, graph {config.graph.mode}, kv "
                         f"{config.cache.kv_cache_dtype})")
    if run.collectives and (report_collectives or config.cp > 1):
        render_df(collectives_per_layer(run.collectives, run.steps), f"collectives per layer per step "
                                                                      f"({run.steps} engine steps)")
    if len(run.kernels):
        render_df(run.kernels, f"Kernel dispatches inside the model (--kernels {config.kernels})")
    path = save_results(run.table, out, "golden", run.meta)
    if len(run.kernels):
        run.kernels.to_csv(path.parent / "golden_kernels.csv", index=False)
    n = len(run.table)
    style = "green" if run.ok else "red"
    toks = f"{int(run.table['tokens_matched'].sum())}/{int(run.table['tokens_total'].sum())}"
    what = "teacher-forced top-1 = golden" if str(config.model.numerics) == "official" else "greedy tokens identical"
    err_console.print(f"[{style}]{run.n_match}/{n} prompts match[/{style}] ({what}: {toks}, "
                      f"max |dlogit| {run.table['max_abs_dlogit'].max():.2e}, tol {run.table['logit_tol'].iloc[0]}; "
                      f"{run.steps} engine steps, {run.meta['preemptions']} preemptions{_spec(run.meta)}; host "
                      f"math {_host_math(run.meta['host_math'])})  ->  {path}")
    raise typer.Exit(0 if run.ok else 1)


def _spec(meta: dict) -> str:
    """e.g. ', mtp k=2: acceptance 0.41 (1.8 tokens per verify step)' when the run speculated."""
    spec = meta.get("speculative")
    if not spec:
        return ""
    if spec["acceptance_rate"] is None:
        return f", {spec['method']} k={spec['num_speculative_tokens']}: nothing drafted"
    return (f", {spec['method']} k={spec['num_speculative_tokens']}: acceptance {spec['acceptance_rate']:.2f} "
            f"({spec['mean_accepted_length']:.2f} tokens per verify step)")


def _host_math(m: dict) -> str:
    """e.g. 'mkl AUTO,STRICT x2': the BLAS, MKL's reproducibility mode (engine/envs.py) and the thread count."""
    return f"{m['blas']}{' ' + m['mkl_cbwr'] if m.get('mkl_cbwr') else ''} x{m['threads']}"
