"""Result tables: every value printed as written."""

import io

import pandas as pd
from rich.console import Console

from deepinfer_bench.report import render_df


def test_values_are_not_read_as_markup() -> None:
    buf = io.StringIO()
    df = pd.DataFrame({"system": ["deepinfer[eager]", "deepinfer[layer]", "[bold]x"], "pass": ["yes", "no", "yes"]})
    render_df(df, "t", console=Console(file=buf, width=200, color_system=None))
    out = buf.getvalue()
    assert "deepinfer[eager]" in out and "deepinfer[layer]" in out and "[bold]x" in out
    assert "[green]" not in out and "[red]" not in out  # the verdict colours stay markup
