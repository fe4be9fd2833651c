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
    from engine.stack import probe

    st = probe()
    rows = [{"item": k, "value": str(v)} for k, v in st["versions"].items()]
    rows += [{"item": k, "value": str(st[k])} for k in ("pjrt_device", "logical_nc_config", "nki_supported", "nki_ok")]
    rows += [{"item": f"host_math.{k}", "value": str(v)} for k, v in st["host_math"].items()]
    render_df(pd.DataFrame(rows), "Stack (torch / XLA / Neuron)")
    if st["neuron_ls"]:
        print(st["neuron_ls"])
    print(f"graph_hash: {envs.graph_hash()}")
