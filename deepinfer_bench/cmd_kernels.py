"""`deepinfer kernels`: run the NKI kernels' case matrices against the torch references."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from deepinfer_bench.app import app


@app.command("kernels")
def kernels_cmd(
    kernel: Annotated[str | None, typer.Option("--kernel", help="Only this kernel family (e.g. rmsnorm).")] = None,
    executor: Annotated[str, typer.Option("--executor", help="auto | stand-in | simulator | neuron")] = "auto",
    out: Annotated[Path | None, typer.Option("--out", help="Write CSV + meta.json under this folder.")] = None,
    slow: Annotated[bool, typer.Option("--slow", help="Also run the cases marked slow (biggest shapes).")] = False,
) -> None:
    """Run every kernel case on the chosen executor; exit 1 if any case fails."""
    from deepinfer_bench.kernels import proves, run_kernels
    from deepinfer_bench.report import err_console, render_df, save_results
    from engine.envs import get_envs
    from nki_kernels.dispatch import resolve_executor
    from nki_kernels.registry import KERNELS

    if kernel is not None and kernel not in KERNELS:
        raise typer.BadParameter(f"--kernel {kernel!r}: expected one of {', '.join(KERNELS)}")
    if executor not in ("auto", "stand-in", "simulator", "neuron"):
        raise typer.BadParameter(f"--executor {executor!r}: expected auto, stand-in, simulator or neuron")
    envs = get_envs()
    if executor == "auto" and envs.DEEPINFER_KERNEL_EXECUTOR != "auto":
        executor = envs.DEEPINFER_KERNEL_EXECUTOR
    simulator = dict(envs.recorded).get("NKI_SIMULATOR", "") == "1"
    from engine.stack import check_nki_version, logical_nc_config, versions
    from nki_kernels import dispatch

    dispatch.set_default(lnc=logical_nc_config())  # the same LNC as the engine's kernel launches
    if executor in ("simulator", "neuron"):
        check_nki_version(versions()["nki"])
    try:
        ex = resolve_executor(executor, simulator=simulator)
    except RuntimeError as e:
        err_console.print(f"[red]{e}[/red]")
        raise typer.Exit(2) from None
    err_console.print(f"executor: {ex} -- {proves(ex)}")
    df = run_kernels(kernel, ex, simulator=simulator, include_slow=slow)
    cols = [c for c in df.columns if c != "note" or df["note"].astype(bool).any()]
    render_df(df, f"NKI kernels on {ex}: {proves(ex)}", columns=cols)
    n_fail = int((~df["pass"].astype(bool)).sum())
    if out is not None:
        path = save_results(df, out, "kernels", {"executor": ex, "proves": proves(ex), "kernel": kernel,
                                                  "slow": slow, "cases": len(df), "failed": n_fail})
        err_console.print(f"wrote {path}")
    err_console.print(f"{len(df) - n_fail}/{len(df)} cases passed on {ex}")
    if n_fail or df.empty:
        raise typer.Exit(1)
