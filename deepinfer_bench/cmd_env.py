"""`deepinfer env` (library: deepinfer_bench/environment.py)."""

from __future__ import annotations

import typer

from deepinfer_bench.app import app
from deepinfer_bench.report import render_df


@app.command("env")
def env_cmd() -> None:
    """Show every DEEPINFER_* flag (value, default, doc), the recorded NEURON_*/NKI_* variables and the stack."""
    from deepinfer_bench.environment import env_tables

    tables, extras = env_tables()
    for title, df in tables:
        render_df(df, title)
    if extras["neuron_ls"]:
        typer.echo(extras["neuron_ls"])
    typer.echo(f"graph_hash: {extras['graph_hash']}")
