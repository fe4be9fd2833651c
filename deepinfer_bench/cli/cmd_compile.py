"""`deepinfer compile` (library: deepinfer_bench/bench/compile.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from deepinfer_bench.bench.report import err_console, render_df
from deepinfer_bench.cli.app import app
from deepinfer_bench.cli.options import EngineArgs, engine_options


@app.command("compile")
@engine_options
def compile_cmd(
    engine: EngineArgs,
    out: Annotated[Path, typer.Option("--out", help="Folder for the graphs (neuron-standin: GRAPH.mlir; xla: "
                                                    "GRAPH.hlo.txt / .hlo.pb; neuron: compile artifacts) and "
                                                    "manifest.json.")] = Path("graphs"),
    workload: Annotated[str, typer.Option("--workload", help="What the engine is sized for (its sizes pick the "
                                          "graphs): golden (every golden prompt at once: what `bringup` runs next) "
                                          "or full (the engine's default sizes: every bucket it knows); "
                                          "--max-num-seqs / --max-model-len / ... override.")] = "golden",
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the graph count and the padding its bucket "
                                          "ladders cost, compile nothing.")] = False,
    graphs: Annotated[str | None, typer.Option("--graphs", help="Only the graphs whose names match one of these "
                                               "comma-separated glob patterns (names as in manifest.json: "
                                               "layer_4_hash_b1_nb1, chunk_*, head_*); a pattern that matches "
                                               "none is an error, before anything compiles (xla: once the "
                                               "others are written).")] = None,
) -> None:
    """Compile every graph an engine step can run, for the backend's offline compiler.

    Compiles or writes each graph a step of the engine can run (every region structure x batch bucket x block
    bucket the config allows, embed and head, and any other graph the region runner lists) for the backend's offline
    compiler, and manifest.json. --backend neuron: neuronx-cc in TorchNeuron's compile-only mode (nothing executes),
    per graph pass / fail, seconds and NCC error code; --backend neuron-standin: StableHLO text per graph, checked;
    --backend xla: HLO modules for scripts/trn2_compile.sh. Exit 1 when a graph fails or carries an f8 type.
    --graphs recompiles only some (the one that failed, after a fix) into the same --out."""
    from deepinfer_bench.bench.compile import compile_graphs, golden_workload
    from deepinfer_bench.bench.graph_budget import budget
    from engine.backends.xla_export import GraphSelectionError

    if workload not in ("golden", "full"):
        raise typer.BadParameter(f"--workload {workload!r}: expected golden or full")
    patterns = tuple(p.strip() for p in (graphs or "").split(",") if p.strip())
    if graphs is not None and not patterns:
        raise typer.BadParameter(f"--graphs {graphs!r}: expected comma-separated glob patterns of graph names")
    sized = golden_workload() if workload == "golden" else None
    config = engine.config(workload=sized, graph_mode=engine.graph_mode or "layer", compile_only=True,
                           check=not dry_run)
    plan = budget(config)
    c = config.cache
    err_console.print(f"{config.backend}, {config.graph.mode}, workload {workload} (max_num_seqs {c.max_num_seqs}, "
                      f"max_model_len {c.max_model_len}, block {c.block_size}, first context bucket "
                      f"{config.graph.min_context_bucket} tokens): {plan.line()}", highlight=False)
    if dry_run:
        return
    which = f"the graphs matching {','.join(patterns)}" if patterns else "the graphs"
    err_console.print(f"compiling {which} of {engine.model_dir} ({config.backend}, {config.graph.mode}, "
                      f"{config.model.dtype}) -> {out}")
    try:
        df, manifest = compile_graphs(config, out, patterns)
    except GraphSelectionError as e:
        raise typer.BadParameter(str(e)) from None
    render_df(df.dropna(axis=1, how="all"), f"{len(df)} graphs ({config.backend}) in {out}")
    failed = int((df["status"] == "fail").sum())
    if df["has_fp8"].fillna(False).astype(bool).any():
        err_console.print("[red]some graphs carry an f8 element type (neuronx-cc rejects f8 operands on trn2: "
                          "NCC_EVRF051)[/red]")
        raise typer.Exit(1)
    if failed:
        err_console.print(f"[red]{failed} of {len(df)} graphs failed (manifest: {manifest})[/red]")
        raise typer.Exit(1)
    nxt = f"; on a trn2: scripts/trn2_compile.sh {out}" if str(config.backend) == "xla" else ""
    err_console.print(f"{len(df)} graphs, manifest {manifest}{nxt}")
