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
    per_layer: Annotated[list[str] | None, typer.Option(
        "--per-layer", help="Golden prompt whose every layer is captured (streams after the attention and MoE "
                            "halves, every position) and compared with the reference's; repeatable.")] = None,
    reference: Annotated[Path | None, typer.Option(
        help="Reference cache dir (`deepinfer reference --out DIR`; default $DEEPINFER_REFERENCE_CACHE or "
             "~/.cache/deepinfer/reference): read from it, made there when absent and transformers is "
             "installed.")] = None,
    out: Annotated[Path, typer.Option(help="Results folder (a new run dir each time).")] = DEFAULT_OUT_DIR,
) -> None:
    """Check the engine's tokens and logits against the independent reference goldens.

    Runs every golden prompt through the engine's serving path (scheduler, KV pool, greedy sampler; on --cp ranks)
    and compares tokens and logits with the HF reference outputs. Exit 1 on any mismatch. fp32: greedy, tokens
    exact, logits within 1e-3 (with --reference and a golden of another model, e.g. a slice: teacher-forced against
    the reference's fp32 logits, the same bounds). Other dtypes: teacher-forced on the golden's tokens, the
    three-way verdict against the HF reference of the model in fp32 and in the run's dtype
    (deepinfer_bench/bench/verdict.py); --per-layer PROMPT names where the engine first leaves the reference's noise
    band. With --numerics official: golden/tiny-official against DeepSeek's own inference code (golden/official, or
    golden/official-fp32 for --dtype float32), teacher-forced, by the statistical bounds of
    deepinfer_bench/bench/golden.py OFFICIAL_TOL."""
    import dataclasses

    from deepinfer_bench.bench.golden import (
        collectives_per_layer,
        default_dirs,
        load_golden,
        run_golden,
        three_way,
        workload,
    )
    from deepinfer_bench.bench.report import DEFAULT_MODEL_DIR

    model_dir, default_golden = default_dirs(engine.numerics or "hf", engine.dtype or "float32")
    if engine.model_dir == DEFAULT_MODEL_DIR:  # not given: the numerics' own tiny model
        engine = dataclasses.replace(engine, model_dir=model_dir)
    cfg = engine.model_config()
    golden_dir = golden_dir or default_golden
    threeway = three_way(engine.numerics, engine.dtype)
    _, prompts = load_golden(golden_dir, cfg, check_model=False)  # sizes the workload; run_golden checks the model
    # every decode step speculates (the check is of the verify path), unless --speculative-policy says otherwise
    config = engine.config(cfg, workload=workload(prompts), speculative_policy="always")
    c = config.cache
    err_console.print(f"[dim]golden: model {engine.model_dir}, {config.model.dtype}, cp {config.cp}, backend "
                      f"{config.backend}, graph {config.graph.mode}, kernels {config.kernels}, weights "
                      f"{config.model.weights}; max_num_seqs "
                      f"{c.max_num_seqs}, max_num_batched_tokens {c.max_num_batched_tokens}, num_kv_blocks "
                      f"{c.num_kv_blocks} x {c.block_size}[/dim]")
    if str(config.backend) != "host":
        from engine.backends import measured_on

        err_console.print(f"[dim]measured on: {measured_on(config.backend)}[/dim]")
    run = run_golden(config, golden_dir, progress=True, reference_dir=reference, per_layer=per_layer or [])
    ref = "the official code, teacher-forced" if str(config.model.numerics) == "official" else \
        "HF reference, teacher-forced, three-way" if threeway else "HF reference"
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
    if threeway:
        _three_way_files(run, path.parent)
    for pl in run.per_layer:
        _per_layer_report(pl, path.parent)
    n = len(run.table)
    style = "green" if run.ok else "red"
    toks = f"{int(run.table['tokens_matched'].sum())}/{int(run.table['tokens_total'].sum())}"
    what = "teacher-forced top-1 = golden" if str(config.model.numerics) == "official" else \
        "teacher-forced top-1 = reference" if run.meta["comparison"].startswith("teacher-forced, exact") else \
        "greedy tokens identical"
    if threeway:
        t, b = run.table, run.meta["band"]
        err_console.print(f"[{style}]{run.n_match}/{n} prompts within the reference's {config.model.dtype} noise, run "
                          f"{'inside' if b['run_passed'] else 'OUTSIDE'} the band[/{style}] (run KLD "
                          f"{b['kld_run']:.2e}, limit {b['kld_run_limit']:.2e}, draws "
                          f"{min(b['kld_run_draws']):.2e}-{max(b['kld_run_draws']):.2e}; worst outlier z "
                          f"{t['outlier_z'].max():.2f}; KLD ratio to the first draw worst {t['kld_ratio'].max():.3g}, "
                          f"max "
                          f"{t['kld_max'].max():.2e}; tokens passing the per-token rule "
                          f"{int(t['tokens_passed'].sum())}/{int(t['tokens_total'].sum())}, top-1 = fp32 {toks}; "
                          f"reference {run.meta['reference_key']})  ->  {path}")
        raise typer.Exit(0 if run.ok else 1)
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


def _three_way_files(run, where: Path) -> None:
    """golden_tokens.csv (every teacher-forced step of every prompt) and, when some token fails the per-token rule,
    the worst token's full logits (engine, reference fp32, reference in the run's dtype) in
    golden_worst_token.safetensors: the largest per-token sigma-ratio of the first failing prompt, else of the
    first prompt with a failing token."""
    import pandas as pd
    from safetensors.torch import save_file

    pd.concat([t.assign(prompt=name) for name, t in run.tokens.items()]).to_csv(where / "golden_tokens.csv",
                                                                                index=False)
    bad = run.table[run.table["first_failing_step"] >= 0]
    if not len(bad):
        return
    worst = bad[bad["verdict"] != "match"]
    row = (worst if len(worst) else bad).iloc[0]
    name, step = str(row["prompt"]), int(row["worst_step"])
    ref = run.reference
    dtype = next(d for d in ref.logits if d != "float32")
    out = where / "golden_worst_token.safetensors"
    save_file({"engine": run.logits[name][step].contiguous(), "reference_float32": ref.logits["float32"][name][step],
               f"reference_{dtype}": ref.logits[dtype][name][step]}, str(out),
              metadata={"prompt": name, "step": str(step), "sigma_ratio": str(float(row["sigma_ratio_max"]))})
    err_console.print(f"[yellow]worst token: {name} step {step} (sigma-ratio {row['sigma_ratio_max']:.3g}); full "
                      f"logits in {out}[/yellow]")


def _per_layer_report(pl, where: Path) -> None:
    """The layer x module x position-bucket table, its CSV, every position's row, and the first divergence."""
    show = pl.table.copy()
    render_df(show, f"per layer: {pl.prompt} (streams after each half; outside = positions outside the noise band)")
    pl.table.to_csv(where / f"golden_layers_{pl.prompt}.csv", index=False)
    pl.positions.to_csv(where / f"golden_positions_{pl.prompt}.csv", index=False)
    if len(pl.kv):
        render_df(pl.kv, f"KV state: {pl.prompt} (window = the last window - 1 positions; entries / index keys by id; "
                         f"outside = rows outside the noise band)")
        pl.kv.to_csv(where / f"golden_kv_{pl.prompt}.csv", index=False)
    if pl.first is None:
        err_console.print(f"[green]{pl.prompt}: every layer inside the reference's noise band at every "
                          f"position[/green]")
        return
    f = pl.first
    pos = f["positions"]
    err_console.print(f"[red]{pl.prompt}: first divergence at layer {f['layer']} {f['module']}, positions "
                      f"{pos[:16]}{' ...' if len(pos) > 16 else ''} ({len(pos)})[/red]")
