"""Result tables: every value printed as written."""

import io

import pandas as pd
from rich.console import Console

from deepinfer_bench.bench.report import render_df


def test_values_are_not_read_as_markup() -> None:
    buf = io.StringIO()
    df = pd.DataFrame({"system": ["deepinfer[eager]", "deepinfer[layer]", "[bold]x"], "pass": ["yes", "no", "yes"]})
    render_df(df, "t", console=Console(file=buf, width=200, color_system=None))
    out = buf.getvalue()
    assert "deepinfer[eager]" in out and "deepinfer[layer]" in out and "[bold]x" in out
    assert "[green]" not in out and "[red]" not in out  # the verdict colours stay markup


def _golden_like() -> pd.DataFrame:
    return pd.DataFrame({
        "prompt": ["text_hello", "ids_321_eos"], "kind": ["text", "ids"], "prompt_len": [7, 321],
        "tokens_matched": [32, 32], "tokens_total": [32, 32], "first_divergent_step": [-1, -1],
        "max_abs_dlogit": [8.82123e-06, 1.10234e-05], "logit_tol": [0.001, 0.001], "verdict": ["match", "match"]})


def test_an_80_column_terminal_cuts_no_value() -> None:
    """A table wider than the terminal is split over several tables (the key column repeated); no value gets an
    ellipsis, every cell appears whole, and no line is wider than the terminal."""
    buf = io.StringIO()
    df = _golden_like()
    render_df(df, "golden", console=Console(file=buf, width=80, force_terminal=True, color_system=None))
    out = buf.getvalue()
    assert "…" not in out
    for col in df.columns:
        assert col in out
    for v in ("8.821e-06", "1.102e-05", "ids_321_eos", "text_hello", "0.001", "match"):
        assert v in out
    assert max(len(line) for line in out.splitlines()) <= 80
    assert "golden (1/2)" in out and out.count("ids_321_eos") == 2  # the key column leads every part


def test_piped_output_is_one_table_at_natural_width() -> None:
    buf = io.StringIO()
    render_df(_golden_like(), "golden", console=Console(file=buf, width=80, color_system=None))  # not a terminal
    out = buf.getvalue()
    assert "…" not in out and "(1/2)" not in out and "8.821e-06" in out
    assert max(len(line) for line in out.splitlines()) > 80
