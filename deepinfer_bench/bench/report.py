"""Results: DataFrame -> rich table (stdout), CSV + meta.json on disk (never overwriting an earlier run)."""

from __future__ import annotations

import datetime as _dt
import json
import math
import platform
import subprocess
import sys
from collections.abc import Mapping
from importlib import metadata
from pathlib import Path
from typing import Any

import pandas as pd
from rich.console import Console
from rich.markup import escape
from rich.measure import Measurement
from rich.table import Table

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_MODEL_DIR = REPO_ROOT / "golden" / "tiny"
DEFAULT_OUT_DIR = Path("results")

out_console = Console()  # tables
# progress, logs, verdicts; piped (CI logs, `2> file`) a line stays one line instead of wrapping at 80 columns
err_console = Console(stderr=True)
if not err_console.is_terminal:
    err_console.soft_wrap = True


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        if value == 0:
            return "0"
        if abs(value) >= 1e4 or abs(value) < 1e-3:
            return f"{value:.3e}"
        return f"{value:.4g}" if abs(value) < 10 else f"{value:.2f}"
    if isinstance(value, bool):
        return "yes" if value else "no"
    return str(value)


def render_df(df: pd.DataFrame, title: str, *, console: Console | None = None, styles: Mapping[str, str] | None = None,
              columns: list[str] | None = None) -> None:
    """Print `df` as rich table(s): numbers right-aligned, NaN as '-'. A value is never cut: on a terminal narrower
    than the table, the columns are split over several tables (each repeating the first column, the row's key);
    piped, the table is printed at its natural width (engine logs, CI)."""
    console = console or out_console
    cols = columns or list(df.columns)
    cells = {c: [escape(_fmt(v)) for v in df[c].tolist()] for c in cols}  # a value is data, not markup
    width = console.width if console.is_terminal else None
    chunks = _column_chunks(cols, cells, width)
    for i, chunk in enumerate(chunks):
        part = title if len(chunks) == 1 else f"{title} ({i + 1}/{len(chunks)})"
        table = Table(title=part, header_style="bold", show_lines=False)
        for c in chunk:
            numeric = pd.api.types.is_numeric_dtype(df[c]) and not pd.api.types.is_bool_dtype(df[c])
            table.add_column(c, justify="right" if numeric else "left", style=(styles or {}).get(c), overflow="fold")
        for r in range(len(df)):
            table.add_row(*(_styled(c, cells[c][r]) for c in chunk))
        print_table(table, console)


def _styled(column: str, text: str) -> str:
    if column in ("verdict", "status", "pass") and text in ("FAIL", "mismatch", "error", "no"):
        return f"[red]{text}[/red]"
    if column in ("verdict", "status", "pass") and text in ("PASS", "match", "ok", "yes"):
        return f"[green]{text}[/green]"
    return text


def _column_chunks(cols: list[str], cells: Mapping[str, list[str]], width: int | None) -> list[list[str]]:
    """`cols` in groups whose tables fit `width` (None: one group), each group after the first led by cols[0]."""
    need = {c: max([len(c), *(len(v) for v in cells[c])]) + 3 for c in cols}  # padding 2 + one border
    if width is None or sum(need.values()) + 1 <= width or len(cols) < 2:
        return [cols]
    key, chunks, cur = cols[0], [], [cols[0]]
    for c in cols[1:]:
        if len(cur) > 1 and sum(need[x] for x in cur) + need[c] + 1 > width:
            chunks.append(cur)
            cur = [key]
        cur.append(c)
    chunks.append(cur)
    return chunks


def print_table(table: Table, console: Console) -> None:
    """On a terminal, as wide as the terminal. Piped to a file (not a TTY, where rich assumes 80 columns and would
    squeeze every header to a few letters), at the table's natural width instead."""
    if console.is_terminal:
        console.print(table)
        return
    probe = Console(file=console.file, width=100_000, color_system=None)
    width = Measurement.get(probe, probe.options, table).maximum
    Console(file=console.file, width=max(20, width), color_system=None, highlight=False).print(table)


def git_sha() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=5)
        sha = out.stdout.strip() or "unknown"
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO_ROOT,
                               capture_output=True, text=True, timeout=5).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def tool_versions() -> dict[str, str]:
    versions = {"python": platform.python_version()}
    for pkg in ("torch", "transformers", "numpy", "pandas", "safetensors", "deepinfer"):
        try:
            versions[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            pass
    return versions


def base_meta(**extra: Any) -> dict[str, Any]:
    from engine.envs import get_envs
    from engine.stack import probe

    meta = {
        "created_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "git_sha": git_sha(),
        "argv": sys.argv,
        "host": platform.node(),
        "platform": platform.platform(),
        "versions": tool_versions(),
        "env": get_envs().snapshot(),
        "stack": probe(),  # torch / torch-xla / torch-neuronx / neuronx-cc / nki versions, PJRT device, LNC, neuron-ls
    }
    meta.update(extra)
    return meta


def _json_default(o: Any) -> Any:
    if isinstance(o, Path):
        return str(o)
    if hasattr(o, "item"):
        return o.item()
    return str(o)


def save_results(df: pd.DataFrame, out_dir: str | Path, name: str, meta: Mapping[str, Any] | None = None) -> Path:
    """Write `<out_dir>/<name>-<timestamp>/{<name>.csv, meta.json}`; a new folder each run, nothing overwritten.

    Returns the CSV path.
    """
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    base = Path(out_dir) / f"{name}-{stamp}"
    run_dir, k = base, 1
    while run_dir.exists():
        k += 1
        run_dir = base.with_name(f"{base.name}-{k}")
    run_dir.mkdir(parents=True)
    csv_path = run_dir / f"{name}.csv"
    df.to_csv(csv_path, index=False)
    full = base_meta(**(dict(meta) if meta else {}))
    full["columns"] = list(df.columns)
    (run_dir / "meta.json").write_text(json.dumps(full, indent=2, default=_json_default) + "\n")
    return csv_path
