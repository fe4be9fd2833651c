"""The Typer application object. Command modules (`cmd_*.py`) register themselves on it; `__init__.py` imports them."""

from __future__ import annotations

import typer

app = typer.Typer(
    name="deepinfer",
    help="Bring-up and benchmarking harness for DeepSeek-V4 (host CPU path and AWS Trainium).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="markdown",
)
bench_app = typer.Typer(help="Benchmarks: offline TTFT/TPOT matrix, engine vs HF, online serving sweep.",
                        no_args_is_help=True, rich_markup_mode="markdown")
app.add_typer(bench_app, name="bench")
