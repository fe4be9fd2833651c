"""`deepinfer serve` (OpenAI-compatible server over the engine: deepinfer_bench/server/serve.py) and `deepinfer bench
serve` (the online sweep: bench/serve_sweep.py): the commands' arguments, their output, their exit codes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer
from rich.markup import escape

from deepinfer_bench.bench.report import DEFAULT_OUT_DIR, err_console, render_df, save_results
from deepinfer_bench.cli.app import app, bench_app
from deepinfer_bench.cli.options import EngineArgs, engine_options


@app.command("serve")
@engine_options
def serve_cmd(
    engine: EngineArgs,
    host: str = typer.Option("127.0.0.1", help="Bind address (loopback by default)."),
    port: int = typer.Option(8000, min=0, max=65535, help="TCP port (checked before the model loads; 0: any free "
                             "port)."),
    served_model_name: str | None = typer.Option(None, help="Model id in /v1/models and requests (default: the "
                                                 "model directory name; the directory path is accepted too)."),
    api_key: str | None = typer.Option(None, help="Require `Authorization: Bearer KEY` on /v1/*, /tokenize."),
    engine_process: bool = typer.Option(True, "--engine-process/--engine-thread", help="Run the engine in a child "
                                        "process (default; no GIL shared with HTTP) or on a thread of the server."),
    drain_timeout: float = typer.Option(5.0, min=0.0, help="On SIGTERM / Ctrl-C: stop accepting, let running "
                                        "requests finish for up to this many seconds, then end the rest (streams: "
                                        "an error event and [DONE]; others: 503), stop the engine, exit 0."),
    log_level: str = typer.Option("info", help="uvicorn log level."),
) -> None:
    """Serve the model over an OpenAI-compatible HTTP API.

    `vllm bench serve --backend openai` works against it."""
    from deepinfer_bench.server.serve import ServeError, ServeOptions, serve, workload

    if (engine.cp or 1) > 1 and not engine_process:
        raise ValueError("--cp > 1 runs the engine on rank processes: use the default --engine-process")
    config = engine.config(workload=workload())
    options = ServeOptions(host=host, port=port, served_model_name=served_model_name, api_key=api_key,
                           engine_process=engine_process, drain_timeout_s=drain_timeout, log_level=log_level,
                           exit_when_done=True)
    try:
        serve(config, options, say=lambda line: err_console.print(line, highlight=False, markup=False))
    except ServeError as e:  # a busy port (before anything loaded), an engine process that failed
        err_console.print(f"[red]error:[/red] {escape(str(e))}", highlight=False, soft_wrap=True)
        raise typer.Exit(2) from None


@bench_app.command("serve")
def bench_serve_cmd(
    base_url: list[str] = typer.Option(["http://127.0.0.1:8000"], help="Server root (with or without /v1); repeat "
                                       "as LABEL=URL to sweep several servers (e.g. plain=..., spec=..., "
                                       "prefix=...: one per engine variant) into one CSV with a `variant` column."),
    matrix: str = typer.Option("serve_quick", help="Matrix name in matrices/ or a TOML path."),
    out: Path = typer.Option(DEFAULT_OUT_DIR, help="Results folder (a new run folder each time)."),
    api_key: str | None = typer.Option(None, help="Bearer token for the server."),
    compare: Path | None = typer.Option(None, help="Offline matrix CSV: add online/offline TTFT and TPOT ratios."),
) -> None:
    """Sweep concurrency x input x output length against an OpenAI-compatible server.

    Reports vLLM's metrics."""
    import pandas as pd

    from deepinfer_bench.bench.serve_sweep import compare_offline, load_serve_matrix, pivot_tables, run_serve_matrix

    try:
        m = load_serve_matrix(matrix)
    except (ValueError, FileNotFoundError) as e:
        raise typer.BadParameter(str(e)) from None

    def progress(k: int, n: int, row: dict[str, Any]) -> None:
        err_console.print(f"[{k}/{n}] concurrency={row['concurrency']} input={row['input_len']} "
                          f"output={row['output_len']}: {row['status']} "
                          f"ttft_p50={row.get('ttft_ms_p50', float('nan')):.1f} ms "
                          f"tpot_p50={row.get('tpot_ms_p50', float('nan')):.2f} ms")

    import httpx

    targets = [tuple(u.split("=", 1)) if "=" in u.split("://", 1)[0] else ("", u) for u in base_url]
    if len(targets) > 1 and (any(not label for label, _ in targets) or len({lb for lb, _ in targets}) < len(targets)):
        raise typer.BadParameter("several servers need distinct labels: --base-url LABEL=URL", param_hint="--base-url")
    dfs = []
    for label, url in targets:
        if label:
            err_console.print(f"variant [bold]{label}[/bold]: {url}")
        try:
            part, info = run_serve_matrix(url, m, api_key=api_key, progress=progress)
        except httpx.HTTPError as e:  # the server is not there, or /v1/models failed
            err_console.print(f"[red]cannot benchmark {url}: {type(e).__name__}: {e}[/red]")
            raise typer.Exit(2) from None
        if label:
            part.insert(0, "variant", label)
        dfs.append(part)
    df = pd.concat(dfs, ignore_index=True)
    base_url = ", ".join(f"{label}={url}" if label else url for label, url in targets)
    render_df(df, f"Serving sweep: {m.name} against {info.model}",
              columns=(["variant"] if "variant" in df else []) + [
                  "concurrency", "input_len", "output_len", "completed", "failed", "ttft_ms_p50",
                       "ttft_ms_p90", "tpot_ms_p50", "tpot_ms_p90", "itl_ms_p50", "e2el_ms_p50", "output_tok_s",
                       "status"])
    for title, table in pivot_tables(df):
        render_df(table, title)
    if compare is not None:
        ratios = compare_offline(df, pd.read_csv(compare))
        render_df(ratios, "online / offline (p50)")
    path = save_results(df, out, f"serve-{m.name}", meta={
        "kind": "serve", "base_url": base_url, "model": info.model, "root": info.root, "matrix": m.name,
        "matrix_def": {k: getattr(m, k) for k in m.__dataclass_fields__}})
    from deepinfer_bench.bench.pareto import SERVE, save_pareto

    png = save_pareto(df, path.with_name(path.stem + "-pareto.png"), SERVE,
                      title=f"{m.name} against {info.model}: points labelled with concurrency")
    err_console.print(f"wrote {path} and {png}")
    if (df.status == "failed").any():
        raise typer.Exit(1)
