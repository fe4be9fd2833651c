"""`deepinfer bench matrix`: the offline TTFT/TPOT matrix (library: deepinfer_bench/matrix.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from deepinfer_bench.app import bench_app
from deepinfer_bench.report import DEFAULT_MODEL_DIR, DEFAULT_OUT_DIR, err_console, render_df, save_results


@bench_app.command("matrix")
def matrix_cmd(
    matrix: Annotated[str, typer.Option("--matrix", help="Matrix name in matrices/ (quick, trn2) or a TOML path.")]
    = "quick",
    model_dir: Annotated[Path, typer.Option("--model-dir", help="Model directory (default: the tiny model).")]
    = DEFAULT_MODEL_DIR,
    cp: Annotated[int, typer.Option("--cp", min=1, help="Context-parallel ranks.")] = 1,
    out: Annotated[Path, typer.Option("--out", help="Results folder; each run gets a new sub-folder.")]
    = DEFAULT_OUT_DIR,
    num_kv_blocks: Annotated[int | None, typer.Option("--num-kv-blocks", min=1, help="KV pool size in blocks "
                                                      "(default: the matrix's, else enough for its largest cell).")]
    = None,
    dtype: Annotated[str | None, typer.Option("--dtype", help="float32 or bfloat16 (default: the matrix's).")]
    = None,
) -> None:
    """Time TTFT and TPOT over batch size x input length x output length; CSV + meta.json + PNG under --out."""
    from deepinfer_bench.matrix import MatrixSpec, engine_config, pivot, resolve_matrix, run_matrix, save_plot

    try:
        path = resolve_matrix(matrix)
        spec = MatrixSpec.from_toml(path)
        config = engine_config(spec, model_dir, cp=cp, num_kv_blocks=num_kv_blocks, dtype=dtype)
    except (OSError, ValueError) as e:
        err_console.print(f"[red]error:[/red] {e}")
        raise typer.Exit(2) from None
    err_console.print(f"matrix [bold]{spec.name}[/bold] ({path}): {len(spec.cells)} cells, warmup {spec.warmup}, "
                      f"repeats {spec.repeats}; engine: max_num_seqs={config.max_num_seqs} "
                      f"num_kv_blocks={config.num_kv_blocks} block_size={config.block_size} "
                      f"max_num_batched_tokens={config.max_num_batched_tokens} dtype={config.dtype} cp={config.cp}")

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=err_console, transient=False) as bar:
        task = bar.add_task("matrix", total=len(spec.cells))

        def progress(done: int, total: int, label: str) -> None:
            bar.update(task, completed=done, description=label or "done")

        try:
            df = run_matrix(spec, config, progress=progress)
        except ValueError as e:  # the engine refused the config (e.g. max_model_len beyond the model's)
            err_console.print(f"[red]error:[/red] {e}")
            raise typer.Exit(2) from None

    for metric, title in (("ttft_ms_p50", "TTFT p50 ms"), ("tpot_ms_p50", "TPOT p50 ms")):
        for o, table in pivot(df, metric).items():
            table["batch_size"] = table["batch_size"].astype(str)  # rendered as a label, not a float
            render_df(table, f"{title}, out={o}")
    skipped = df[df["status"] != "ok"]
    if len(skipped):
        render_df(skipped[["batch_size", "input_len", "output_len", "status", "skip_reason"]],
                  "Skipped / failed cells")
    meta = {"matrix": spec.name, "matrix_path": str(path), "spec": spec.__dict__, "engine_config": config.__dict__,
            "model_config_hash": _model_config_hash(model_dir)}
    csv_path = save_results(df, out, f"matrix-{spec.name}", meta)
    png = save_plot(df, csv_path.with_suffix(".png"), title=f"matrix {spec.name}")
    err_console.print(f"wrote {csv_path}, {csv_path.parent / 'meta.json'} and {png}")
    if (df["status"] == "error").any():
        raise typer.Exit(1)


def _model_config_hash(model_dir: Path) -> str | None:
    from engine.config import ConfigError, ModelConfig

    try:
        return ModelConfig.from_json(model_dir).config_hash()
    except (ConfigError, OSError):
        return None
