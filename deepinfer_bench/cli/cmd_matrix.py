"""`deepinfer bench matrix`: the offline TTFT/TPOT matrix (library: deepinfer_bench/bench/matrix.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from deepinfer_bench.bench.report import DEFAULT_OUT_DIR, err_console, render_df, save_results
from deepinfer_bench.cli.app import bench_app
from deepinfer_bench.cli.options import EngineArgs, engine_options


@bench_app.command("matrix")
@engine_options
def matrix_cmd(
    engine: EngineArgs,
    matrix: Annotated[str, typer.Option("--matrix", help="Matrix name in matrices/ (quick, trn2) or a TOML path.")]
    = "quick",
    out: Annotated[Path, typer.Option("--out", help="Results folder; each run gets a new sub-folder.")]
    = DEFAULT_OUT_DIR,
) -> None:
    """Time TTFT and TPOT over batch size x input length x output length.

    Writes CSV + meta.json + PNG under --out."""
    from deepinfer_bench.bench.matrix import MatrixSpec, engine_sizing, pivot, resolve_matrix, run_matrix, save_plot

    path = resolve_matrix(matrix)
    spec = MatrixSpec.from_toml(path)
    workload, fixed = engine_sizing(spec)
    config = engine.config(workload=workload, **fixed)
    c = config.cache
    err_console.print(f"matrix [bold]{spec.name}[/bold] ({path}): {len(spec.cells)} cells, warmup {spec.warmup}, "
                      f"repeats {spec.repeats}; engine: max_num_seqs={c.max_num_seqs} num_kv_blocks={c.num_kv_blocks} "
                      f"block_size={c.block_size} max_num_batched_tokens={c.max_num_batched_tokens} "
                      f"dtype={config.model.dtype} cp={config.cp} backend={config.backend} graph={config.graph.mode}")

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=err_console, transient=False) as bar:
        task = bar.add_task("matrix", total=len(spec.cells))

        def progress(done: int, total: int, label: str) -> None:
            bar.update(task, completed=done, description=label or "done")

        df = run_matrix(spec, config, progress=progress)

    from engine.backends import measured_on

    where = measured_on(config.backend)
    for metric, title in (("ttft_ms_p50", "TTFT p50 ms"), ("tpot_ms_p50", "TPOT p50 ms")):
        for o, table in pivot(df, metric).items():
            table["batch_size"] = table["batch_size"].astype(str)  # rendered as a label, not a float
            render_df(table, f"{title}, out={o} ({where})")
    skipped = df[df["status"] != "ok"]
    if len(skipped):
        render_df(skipped[["batch_size", "input_len", "output_len", "status", "skip_reason"]],
                  "Skipped / failed cells")
    meta = {"matrix": spec.name, "matrix_path": str(path), "spec": spec.__dict__, "engine_config": config.to_dict(),
            "measured_on": where, "backend": df.attrs.get("backend", {}),
            "kv_cache_dtype": str(config.cache.kv_cache_dtype),
            "kv_cache_bytes_per_token": df.attrs.get("kv_cache_bytes_per_token")}
    csv_path = save_results(df, out, f"matrix-{spec.name}", meta)
    png = save_plot(df, csv_path.with_suffix(".png"), title=f"matrix {spec.name} ({where})")
    err_console.print(f"wrote {csv_path}, {csv_path.parent / 'meta.json'} and {png}")
    if (df["status"] == "error").any():
        raise typer.Exit(1)

