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
    variants: Annotated[str | None, typer.Option("--variants", help="Run the matrix once per engine variant, "
                                                 "comma-separated: plain, spec (MTP, --num-speculative-tokens or "
                                                 "2), prefix (prefix caching), spec+prefix; adds a `variant` column "
                                                 "and a Pareto PNG (tokens/s per user vs total).")] = None,
) -> None:
    """Time TTFT and TPOT over batch size x input length x output length.

    Writes CSV + meta.json + PNG under --out; with --variants also a Pareto PNG."""
    import pandas as pd

    from deepinfer_bench.bench.matrix import MatrixSpec, engine_sizing, pivot, resolve_matrix, run_matrix, save_plot
    from deepinfer_bench.cli.options import user_errors

    path = resolve_matrix(matrix)
    spec = MatrixSpec.from_toml(path)
    workload, fixed = engine_sizing(spec)
    config = engine.config(workload=workload, **fixed)
    with user_errors():
        runs = {name: config.replace(**VARIANTS[name](engine)) for name in parse_variants(variants)} \
            if variants else {"": config}
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

        dfs = []
        for name, cfg in runs.items():
            if name:
                err_console.print(f"variant [bold]{name}[/bold]: speculative={cfg.spec.method.value} "
                                  f"prefix_caching={cfg.prefix_caching}")
                bar.update(task, completed=0)
            part = run_matrix(spec, cfg, progress=progress)
            if name:
                part.insert(0, "variant", name)
            dfs.append(part)
        df = pd.concat(dfs, ignore_index=True) if len(dfs) > 1 else dfs[0]
        df.attrs = dfs[0].attrs

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
    if variants:
        from deepinfer_bench.bench.pareto import MATRIX, save_pareto

        pareto = save_pareto(df, csv_path.with_name(csv_path.stem + "-pareto.png"), MATRIX,
                             title=f"matrix {spec.name} ({where}): points labelled with batch size")
        png = f"{png} and {pareto}"
    err_console.print(f"wrote {csv_path}, {csv_path.parent / 'meta.json'} and {png}")
    if (df["status"] == "error").any():
        raise typer.Exit(1)



def _spec(engine: EngineArgs) -> dict:
    given = str(getattr(engine.speculative, "value", engine.speculative or "none"))
    return {"speculative": "mtp" if given == "none" else given,
            "num_speculative_tokens": engine.num_speculative_tokens or 2}


_PLAIN = {"speculative": "none", "num_speculative_tokens": 0}
VARIANTS = {  # variant name -> the engine settings it overrides
    "plain": lambda e: {**_PLAIN, "enable_prefix_caching": False},
    "spec": lambda e: {**_spec(e), "enable_prefix_caching": False},
    "prefix": lambda e: {**_PLAIN, "enable_prefix_caching": True},
    "spec+prefix": lambda e: {**_spec(e), "enable_prefix_caching": True},
}


def parse_variants(text: str) -> list[str]:
    names = [v.strip() for v in text.split(",") if v.strip()]
    bad = [v for v in names if v not in VARIANTS]
    if bad or not names:
        raise typer.BadParameter(f"unknown variant(s) {', '.join(bad) or '(none given)'}; choose from "
                                 f"{', '.join(VARIANTS)}", param_hint="--variants")
    return list(dict.fromkeys(names))
