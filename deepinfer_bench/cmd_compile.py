"""`deepinfer compile`: every decode graph of the engine as HLO for neuronx-cc (library: engine/hlo_export.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import pandas as pd
import typer

from deepinfer_bench.app import app
from deepinfer_bench.options import EngineArgs, engine_options
from deepinfer_bench.report import base_meta, err_console, render_df


@app.command("compile")
@engine_options
def compile_cmd(
    engine: EngineArgs,
    out: Annotated[Path, typer.Option("--out", help="Folder for <graph>.hlo.txt / .hlo.pb and manifest.json.")]
    = Path("hlo"),
) -> None:
    """Trace each decode region graph (every region structure x batch bucket x block bucket the config allows,
    plus embed and head) on the XLA device and write its HLO module (text + serialized proto) and manifest.json.
    Nothing runs; then `scripts/trn2_compile.sh DIR` compiles each with neuronx-cc on a trn2 host."""
    import engine as engine_pkg
    from engine.hlo_export import decode_shapes, export_decode_graphs
    from engine.stack import probe

    cfg = engine.model_config()
    config = engine.config(cfg, graph_mode=engine.graph_mode or "layer")
    if str(config.backend) not in ("xla", "neuron"):
        raise typer.BadParameter("deepinfer compile traces XLA graphs: use --backend xla (PJRT_DEVICE=CPU here) "
                                 "or --backend neuron", param_hint="--backend")
    eng = engine_pkg.build(config)
    shapes = decode_shapes(eng.runner)
    err_console.print(f"tracing decode graphs of {engine.model_dir} ({config.graph.mode}, {config.model.dtype}): "
                      f"{len(shapes)} (batch, block) buckets -> {out}")
    rows = export_decode_graphs(eng.runner, out)
    manifest = {**base_meta(kind="compile"), "engine_config": config.to_dict(), "stack": probe(),
                "backend": eng.runner.backend.metrics(), "graphs": rows}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1, default=str) + "\n")
    df = pd.DataFrame([{k: r[k] for k in ("graph", "region", "ratio", "batch_bucket", "block_bucket", "hlo_bytes",
                                           "has_fp8")} for r in rows])
    render_df(df, f"{len(rows)} graphs written to {out}")
    if df["has_fp8"].any():
        err_console.print("[red]some graphs carry an f8 element type (neuronx-cc rejects it: NCC_EOCP001)[/red]")
        raise typer.Exit(1)
    err_console.print(f"wrote {len(rows)} HLO modules and {out / 'manifest.json'}; on a trn2: "
                      f"scripts/trn2_compile.sh {out}")
