"""`deepinfer regions`: the command on the tiny model (region functions uncompiled: `--host-compiler none`)."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
from typer.testing import CliRunner

from deepinfer_bench.bench.region_timing import RegionsSpec, native_table, tabulate
from deepinfer_bench.cli import app
from engine.config import EngineConfig

TINY = Path(__file__).resolve().parents[1] / "golden" / "tiny"


def test_regions_command_writes_results(tmp_path: Path) -> None:
    res = CliRunner().invoke(app, ["regions", "--timing", "--graph-mode", "layer", "--host-compiler", "none",
                                   "--batch", "2", "--context", "9", "--steps", "2", "--warmup", "1",
                                   "--out", str(tmp_path)])
    assert res.exit_code == 0, res.output
    run = next(tmp_path.iterdir())
    assert {p.name for p in run.iterdir()} >= {"regions.csv", "regions_summed.csv", "regions_summary.csv",
                                               "meta.json", "regions.png", "regions_vs_plan.csv"}
    summary = pd.read_csv(run / "regions_summary.csv").iloc[0]
    cfg_layers = 4
    assert summary["graph_launches_per_step"] == cfg_layers
    assert 0.5 < summary["stage_sum_over_step"] <= 1.05
    stages = set(pd.read_csv(run / "regions.csv")["stage"])
    assert {"attn.qkv", "attn.core", "moe.experts"} <= stages
    # the plan beside it: layer mode's measured `layer` region against the plan's two halves, with the engine's own
    # call overhead (measured on a width-free copy) in each prediction
    vs = pd.read_csv(run / "regions_vs_plan.csv").set_index("region")
    assert set(vs.index) == {"embed", "layer", "head", "step"} and (vs["predicted_ms"] > 0).all()
    assert "predicted_over_p50" in vs.columns


def test_tabulate_shares() -> None:
    spec = RegionsSpec(steps=2)
    config = EngineConfig.from_model_dir(TINY, graph_mode="regions", host_compiler="none")
    timing = [{"region": "attn", "stage": "attn.qkv", "layer": 0, "calls": 2, "total_ms": 2.0, "p50_ms": 1.0,
               "p90_ms": 1.0},
              {"region": "attn", "stage": "attn.qkv", "layer": 1, "calls": 2, "total_ms": 4.0, "p50_ms": 2.0,
               "p90_ms": 2.0}]
    r = tabulate(config, spec, [5.0, 5.0], timing, {"graph_launches_per_step": 8})
    assert r.summed.iloc[0]["ms_per_step"] == 3.0 and r.summed.iloc[0]["layers"] == 2
    assert r.summary.iloc[0]["stage_sum_over_step"] == pytest.approx(0.6)


def test_regions_timing_on_the_host_kernels_times_every_native_call(tmp_path: Path) -> None:
    """Eager decode on the host kernel table (what `auto` picks): every `dk_*` call counted and timed, and the rest
    of the step outside them, which the rows sum to."""
    res = CliRunner().invoke(app, ["regions", "--timing", "--graph-mode", "eager", "--kernels", "host", "--batch", "2",
                                   "--context", "9", "--steps", "3", "--warmup", "1", "--out", str(tmp_path)])
    assert res.exit_code == 0, res.output
    run = next(tmp_path.iterdir())
    native = pd.read_csv(run / "regions_host_kernels.csv")
    step_mean = pd.read_csv(run / "regions_summary.csv").iloc[0]["step_ms_mean"]
    assert list(native["kernel"])[-1] == "(outside the native calls)"
    kernels = native.iloc[:-1]
    assert len(kernels) and all(k.startswith("dk_") for k in kernels["kernel"])
    assert (kernels["calls_per_step"] > 0).all()
    # the final norm runs natively on any build: inside the one-call LM head, or on its own where that declines
    assert {"dk_lm_head", "dk_rms_norm"} & set(kernels["kernel"])
    assert native["ms_per_step"].sum() == pytest.approx(step_mean)
    assert native["share_of_step"].sum() == pytest.approx(1.0)
    assert (kernels["ms_per_step"] > 0).all() and native.iloc[-1]["ms_per_step"] > 0


def test_native_table_rows_per_step() -> None:
    rows = [{"kernel": "dk_moe_ffn", "calls": 8, "total_ms": 6.0},
            {"kernel": "dk_rms_norm", "calls": 4, "total_ms": 1.0}]
    df = native_table(rows, 2, 5.0)
    assert list(df["kernel"]) == ["dk_moe_ffn", "dk_rms_norm", "(outside the native calls)"]
    assert list(df["calls_per_step"][:2]) == [4.0, 2.0] and list(df["ms_per_step"]) == [3.0, 0.5, 1.5]
    assert df["share_of_step"].sum() == pytest.approx(1.0)
    assert native_table([], 2, 5.0).empty
