"""`deepinfer kernels` (library: deepinfer_bench/bench/kernels.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from deepinfer_bench.bench.report import DEFAULT_OUT_DIR
from deepinfer_bench.cli.app import app


@app.command("kernels")
def kernels_cmd(
    kernel: Annotated[str | None, typer.Option("--kernel", help="Only this kernel family (e.g. rmsnorm).")] = None,
    executor: Annotated[str, typer.Option("--executor", help="auto | stand-in | simulator | neuron")] = "auto",
    out: Annotated[Path, typer.Option("--out", help="Results folder; each run gets a new sub-folder (CSV + "
                                                    "meta.json).")] = DEFAULT_OUT_DIR,
    slow: Annotated[bool, typer.Option("--slow", help="Also run the cases marked slow (biggest shapes).")] = False,
) -> None:
    """Run every kernel case on the chosen executor against its torch reference.

    Exit 1 if any case fails."""
    from deepinfer_bench.bench import kernels as lib
    from deepinfer_bench.bench.report import err_console, render_df, save_results
    from engine.envs import apply_env

    ex, simulator = lib.resolve_run(kernel, executor)
    env = lib.kernel_env(ex)
    apply_env(env)  # before the first launch: the kernels' LNC
    err_console.print(f"executor: {ex} -- {lib.proves(ex)}" + "".join(f"; {k}={v}" for k, v in env.items()))
    df = lib.run_kernels(kernel, ex, simulator=simulator, include_slow=slow)
    cols = [c for c in df.columns if c != "note" or df["note"].astype(bool).any()]
    render_df(df, f"NKI kernels on {ex}: {lib.proves(ex)}", columns=cols)
    n_fail = int((~df["pass"].astype(bool)).sum())
    path = save_results(df, out, "kernels", {"executor": ex, "proves": lib.proves(ex), "kernel": kernel,
                                              "slow": slow, "cases": len(df), "failed": n_fail, "env": env})
    err_console.print(f"{len(df) - n_fail}/{len(df)} cases passed on {ex}  ->  {path}")
    if n_fail or df.empty:
        raise typer.Exit(1)
