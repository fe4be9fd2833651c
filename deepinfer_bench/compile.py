"""`deepinfer compile`: every graph of the engine written for its backend's offline compiler.

The engine is built on the chosen backend in graph mode (layer by default) and the backend writes each graph a
step can run (`Backend.export_graphs`: on xla, HLO text + proto per region structure x batch bucket x block bucket,
plus embed and head, for neuronx-cc). Nothing is executed. `manifest.json` lists every graph with the engine config
and the stack."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pandas as pd

SUMMARY_COLUMNS = ("graph", "region", "ratio", "batch_bucket", "block_bucket", "hlo_bytes", "has_fp8")


def compile_graphs(config: Any, out: Path) -> tuple[pd.DataFrame, Path]:
    """Build the engine of `config` and write its graphs under `out`; (one row per graph, the manifest path)."""
    import engine
    from deepinfer_bench.report import base_meta
    from engine.stack import probe

    eng = engine.build(config)
    backend = eng.runner.backend
    rows = backend.export_graphs(eng.runner, Path(out))
    manifest = {**base_meta(kind="compile"), "engine_config": config.to_dict(), "stack": probe(),
                "backend": backend.counters().to_dict(), "graphs": rows}
    path = Path(out) / "manifest.json"
    path.write_text(json.dumps(manifest, indent=1, default=str) + "\n")
    df = pd.DataFrame([{k: r.get(k) for k in SUMMARY_COLUMNS} for r in rows], columns=list(SUMMARY_COLUMNS))
    return df, path
