"""`deepinfer bringup` (library: deepinfer_bench/bench/bringup.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from deepinfer_bench.bench.report import DEFAULT_OUT_DIR, base_meta, err_console, render_df
from deepinfer_bench.cli.app import app


@app.command("bringup")
def bringup_cmd(
    backend: Annotated[str, typer.Option("--backend", help="neuron (TorchNeuron on a trn2) or neuron-standin (its "
                                                           "compile pipeline on a CPU stand-in); auto: neuron where a "
                                                           "Neuron device and TorchNeuron are, else neuron-standin")]
    = "auto",
    model_dir: Annotated[str | None, typer.Option("--model-dir", help="Model of the compile / regions / matrix steps "
                                                                      "and of the golden-model-bf16 step (the other "
                                                                      "golden steps run the tiny model).")] = None,
    reference: Annotated[str | None, typer.Option("--reference", help="Reference cache dir of the golden bf16 steps "
                                                                      "(deepinfer reference --out DIR, made on a CPU "
                                                                      "box; default: the reference cache).")] = None,
    compile_sizes: Annotated[str | None, typer.Option("--compile-sizes", help="Engine options the compile-only step "
                                                                              "sizes the engine with (every graph of "
                                                                              "that size; default: --workload golden, "
                                                                              "what the golden steps run).")] = None,
    skip: Annotated[str, typer.Option("--skip", help="Comma-separated steps not to run (listed as not run): probe, "
                                                     "kernels, compile-only, golden-cp1, golden-cp2, "
                                                     "golden-bf16, golden-model-bf16, regions, matrix.")] = "",
    out: Annotated[Path, typer.Option("--out", help="Results folder; each run gets a new sub-folder.")]
    = DEFAULT_OUT_DIR,
) -> None:
    """Bring up a new Neuron host: each check in order, stopping at the first failure.

    The steps: probe -> kernels on the device -> compile-only of every graph -> golden tiny cp 1 -> cp 2 -> golden
    tiny bf16 (three-way verdict) -> golden bf16 of --model-dir -> regions timing -> quick matrix. Stops at the first
    failing step and names it; steps that cannot run on the backend are listed as not run. One report: bringup.md,
    bringup.csv, meta.json. Exit 1 when a step failed."""
    import datetime as _dt
    import shlex

    from deepinfer_bench.bench.bringup import DEFAULT_COMPILE_SIZES, STEPS, Plan, bringup, markdown
    from engine.backends import measured_on
    from engine.config import Backend, resolve_backend

    if backend == "auto":
        chosen = resolve_backend("auto")
        backend = "neuron" if chosen is Backend.NEURON else "neuron-standin"
    if backend not in ("neuron", "neuron-standin"):
        raise ValueError(f"bringup --backend {backend!r}: expected neuron, neuron-standin or auto")
    skipped = frozenset(s.strip() for s in skip.split(",") if s.strip())
    unknown = sorted(skipped - set(STEPS))
    if unknown:
        raise ValueError(f"bringup --skip {','.join(unknown)}: unknown step(s); the steps are {', '.join(STEPS)}")
    run_dir = Path(out) / f"bringup-{_dt.datetime.now().strftime('%Y%m%d-%H%M%S')}"
    sizes = tuple(shlex.split(compile_sizes)) if compile_sizes is not None else DEFAULT_COMPILE_SIZES
    plan = Plan(backend=backend, out=run_dir, model_dir=model_dir, compile_sizes=sizes,
                skip=skipped, reference=reference)
    err_console.print(f"[dim]bringup: --backend {backend} -> {run_dir}[/dim]")
    df, meta = bringup(plan, progress=lambda step, state: err_console.print(f"[dim]{step}: {state}[/dim]"))
    label = measured_on(backend)
    df.to_csv(run_dir / "bringup.csv", index=False)
    (run_dir / "bringup.md").write_text(markdown(df, meta, label))
    (run_dir / "meta.json").write_text(json.dumps({**base_meta(kind="bringup"), "measured_on": label, **meta},
                                                  indent=1, default=str) + "\n")
    render_df(df.drop(columns=["log", "env"]), f"bringup (--backend {backend}): {label}")
    if not meta["ok"]:
        err_console.print(f"[red]stopped at step {meta['first_failure']}[/red] -> {run_dir / 'bringup.md'}")
        raise typer.Exit(1)
    err_console.print(f"[green]every step that ran passed[/green] (not run: "
                      f"{', '.join(meta['not_run']) or 'none'}) -> {run_dir / 'bringup.md'}")
