"""`deepinfer env`: the resolved DEEPINFER_* flags and recorded runtime variables."""

from __future__ import annotations

import pandas as pd

from deepinfer_bench.app import app
from deepinfer_bench.report import render_df


@app.command("env")
def env_cmd() -> None:
    """Show every DEEPINFER_* flag (value, default, doc) and the recorded NEURON_*/NKI_* variables."""
    from engine.envs import Envs, get_envs

    envs = get_envs()
    rows = [{"flag": name, "value": repr(getattr(envs, name)), "default": default, "type": typ, "doc": doc}
            for name, typ, default, doc in Envs.describe()]
    render_df(pd.DataFrame(rows), "DEEPINFER_* flags")
    if envs.recorded:
        render_df(pd.DataFrame([{"variable": k, "value": v} for k, v in envs.recorded]), "Recorded runtime variables")
    print(f"graph_hash: {envs.graph_hash()}")
