"""`deepinfer compile` (library: deepinfer_bench/compile.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from deepinfer_bench.app import app
from deepinfer_bench.options import EngineArgs, engine_options
from deepinfer_bench.report import err_console, render_df


@app.command("compile")
@engine_options
def compile_cmd(
    engine: EngineArgs,
    out: Annotated[Path, typer.Option("--out", help="Folder for the graphs (xla: <graph>.hlo.txt / .hlo.pb) and "
                                                    "manifest.json.")] = Path("hlo"),
) -> None:
    """Write each graph a step of the engine can run (every region structure x batch bucket x block bucket the
    config allows, plus embed and head) for the backend's offline compiler, and manifest.json. Nothing runs; on
    --backend xla the HLO modules go to `scripts/trn2_compile.sh DIR` (neuronx-cc on a trn2 host)."""
    from deepinfer_bench.compile import compile_graphs

    config = engine.config(graph_mode=engine.graph_mode or "layer")
    err_console.print(f"writing the graphs of {engine.model_dir} ({config.backend}, {config.graph.mode}, "
                      f"{config.model.dtype}) -> {out}")
    df, manifest = compile_graphs(config, out)
    render_df(df, f"{len(df)} graphs written to {out}")
    if df["has_fp8"].fillna(False).astype(bool).any():
        err_console.print("[red]some graphs carry an f8 element type (neuronx-cc rejects it: NCC_EOCP001)[/red]")
        raise typer.Exit(1)
    err_console.print(f"wrote {len(df)} graphs and {manifest}; on a trn2: scripts/trn2_compile.sh {out}")
