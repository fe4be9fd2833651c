"""`deepinfer compile`: every graph of the engine compiled or written for its backend's offline compiler.

The engine is built on the chosen backend in graph mode (layer by default), sized for a workload (default: the golden
prompts, what `bringup` runs next), and the backend handles each graph a step can run (`Backend.export_graphs`:
every region structure x batch bucket x block bucket, embed and head, the prefill chunk graphs where the engine runs
chunks as graphs, and any graph the RegionRunner lists besides); the count (deepinfer_bench/bench/graph_budget.py) is
printed before anything compiles:
* `neuron`: TorchNeuron in compile-only mode (TORCH_NEURONX_COMPILE_ONLY=1, NEURON_PLATFORM_TARGET_OVERRIDE=trn2, set
  here before the engine is built): neuronx-cc compiles each graph, nothing executes; per graph pass / fail, seconds,
  NCC error code;
* `neuron-standin`: each graph's StableHLO text (`<graph>.mlir`, lowered by the TorchNeuron stand-in, checked for f8
  types and unlowered torch ops);
* `xla`: HLO text + proto per graph for neuronx-cc (`scripts/trn2_compile.sh`).
`manifest.json` lists every graph with the engine config, the stack and what the graphs were measured on."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pandas as pd

SUMMARY_COLUMNS = ("graph", "region", "ratio", "batch_bucket", "chunk_bucket", "block_bucket", "status", "seconds",
                   "ncc_error", "has_fp8", "hlo_bytes", "mlir")


def golden_workload() -> Any:
    """The golden prompts at once (deepinfer_bench/golden.py `workload`): what `bringup` runs after compiling, so
    the graphs compiled are those its golden steps reach."""
    from deepinfer_bench.bench.golden import default_dirs, load_golden, workload
    from engine.config import ModelConfig

    model_dir, golden_dir = default_dirs()
    _, prompts = load_golden(golden_dir, ModelConfig.from_json(model_dir))
    return workload(prompts)


def compile_graphs(config: Any, out: Path, graphs: Sequence[str] = ()) -> tuple[pd.DataFrame, Path]:
    """Build the engine of `config` and compile / write its graphs under `out` (or those the glob patterns `graphs`
    select: the manifest's `selected`; its budget still counts every graph); (one row per graph, the manifest
    path). Rows of a backend that writes files without compiling (xla) have status "written"."""
    import engine
    from deepinfer_bench.bench.graph_budget import budget
    from deepinfer_bench.bench.report import base_meta
    from engine.backends import backend_class, measured_on
    from engine.envs import apply_env, get_envs
    from engine.stack import probe

    cls = backend_class(config.backend)
    env = cls.compile_only_env(Path(out)) if hasattr(cls, "compile_only_env") else {}
    if "TORCH_NEURONX_DEBUG_DIR" in dict(get_envs().recorded):
        env.pop("TORCH_NEURONX_DEBUG_DIR", None)  # the user's artifact folder is kept
    if env:
        apply_env(env)  # before the engine (and the backend's runtime) starts: before anything compiles
    eng = engine.build(config)
    backend = eng.runner.backend
    rows = backend.export_graphs(eng.runner, Path(out), tuple(graphs))
    for r in rows:
        r.setdefault("status", "written")
    manifest = {**base_meta(kind="compile"), "engine_config": config.to_dict(), "stack": probe(),
                "measured_on": measured_on(config.backend), "compile_env": env, "budget": budget(config).to_dict(),
                "selected": list(graphs) or None,
                "backend": backend.counters().to_dict(), "graphs": rows}
    path = Path(out) / "manifest.json"
    path.write_text(json.dumps(manifest, indent=1, default=str) + "\n")
    df = pd.DataFrame([{k: r.get(k) for k in SUMMARY_COLUMNS} for r in rows], columns=list(SUMMARY_COLUMNS))
    return df, path
