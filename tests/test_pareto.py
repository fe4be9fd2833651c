"""The sweep's Pareto plot (deepinfer_bench/bench/pareto.py): its points and frontier, and `bench matrix --variants` on
the tiny model writing the PNG beside the CSV with one row per variant and cell."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
from typer.testing import CliRunner

from deepinfer_bench.bench import pareto

TINY = Path(__file__).resolve().parents[1] / "golden" / "tiny"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _serve_df() -> pd.DataFrame:
    # variant a: concurrency 1 fast per user, 4 more total; b at 4 is dominated by a at 4
    return pd.DataFrame({
        "variant": ["a", "a", "b", "b"], "concurrency": [1, 4, 1, 4], "status": ["ok"] * 4,
        "output_tok_s": [50.0, 160.0, 40.0, 150.0], "tpot_ms_p50": [10.0, 20.0, 12.0, 25.0],
        "tpot_ms_p99": [12.0, 30.0, 14.0, 40.0], "ttft_ms_p99": [200.0, 900.0, 1600.0, 800.0]})


def test_points_frontier_and_mlperf_marks() -> None:
    pts = pareto.points(_serve_df(), pareto.SERVE)
    assert pts["per_user"].round(3).tolist() == [100.0, 50.0, 83.333, 40.0]
    # MLPerf Interactive: p99 TPOT <= 15 ms and p99 TTFT <= 1.5 s; only (a, 1) meets both ((b, 1): TTFT 1.6 s)
    assert pts["meets_mlperf"].tolist() == [True, False, False, False]
    f = pareto.frontier(pts)
    assert list(zip(f["variant"], f["load"], strict=True)) == [("a", 1), ("a", 4)]


def test_save_pareto_writes_a_png(tmp_path: Path) -> None:
    path = pareto.save_pareto(_serve_df(), tmp_path / "p.png", pareto.SERVE)
    assert path.read_bytes()[:8] == PNG_MAGIC


def test_bench_matrix_variants_write_the_pareto_png(tmp_path: Path) -> None:
    """A small run against the tiny model: plain, MTP speculation and prefix caching, 2 batch sizes each."""
    from deepinfer_bench.cli import app

    m = tmp_path / "mini.toml"
    m.write_text("batch_size = [1, 2]\ninput_len = [20]\noutput_len = [6]\nwarmup = 0\nrepeats = 1\n"
                 "dtype = \"float32\"\n")
    res = CliRunner().invoke(app, ["bench", "matrix", "--matrix", str(m), "--model-dir", str(TINY), "--out",
                                   str(tmp_path / "out"), "--variants", "plain,spec,prefix", "--kernels", "reference"])
    assert res.exit_code == 0, res.output
    (csv,) = (tmp_path / "out").glob("matrix-mini-*/matrix-mini.csv")
    df = pd.read_csv(csv)
    assert df["variant"].tolist() == ["plain", "plain", "spec", "spec", "prefix", "prefix"]
    assert (df["status"] == "ok").all()
    assert (df[df.variant == "spec"]["tokens_per_step"] > 1).all()  # the MTP head really drafted
    png = csv.with_name("matrix-mini-pareto.png")
    assert png.read_bytes()[:8] == PNG_MAGIC


def test_bench_matrix_unknown_variant_is_a_clear_error(tmp_path: Path) -> None:
    from deepinfer_bench.cli import app

    res = CliRunner().invoke(app, ["bench", "matrix", "--model-dir", str(TINY), "--out", str(tmp_path),
                                   "--variants", "plain,turbo"])
    assert res.exit_code == 2 and "turbo" in res.output
