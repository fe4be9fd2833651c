"""`deepinfer env` (library: deepinfer_bench/bench/environment.py)."""

from __future__ import annotations

import typer

from deepinfer_bench.bench.report import render_df
from deepinfer_bench.cli.app import app


@app.command("env")
def env_cmd() -> None:
    """Show the DEEPINFER_* flags, the recorded Neuron and NKI variables, and the stack.

    Each flag with its value, default and doc."""
    from deepinfer_bench.bench.environment import env_tables

    tables, extras = env_tables()
    for title, df in tables:
        render_df(df, title)
    if extras["neuron_ls"]:
        typer.echo(extras["neuron_ls"])
    typer.echo(f"graph_hash: {extras['graph_hash']}")
