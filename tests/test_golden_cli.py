"""`deepinfer golden` end to end on the committed tiny model and golden data (independent HF reference)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pandas as pd
import pytest
from typer.testing import CliRunner

from deepinfer_bench.cli import app
from deepinfer_bench.golden import GOLDEN_DIR, GoldenError, collectives_per_layer, load_golden, run_golden
from engine.config import ModelConfig

TINY = GOLDEN_DIR / "tiny"


def test_golden_cp2_chunked_prefill_matches_with_one_moe_allgather_per_layer() -> None:
    run = run_golden(TINY, GOLDEN_DIR, dtype="float32", cp=2, prefill_chunk=37)
    assert run.ok, run.table.to_string()
    per_layer = collectives_per_layer(run.collectives, run.steps)
    assert (per_layer["moe.exchange:all_gather"] == 1).all()
    assert (per_layer["moe.combine:all_reduce"] == 1).all()
    assert (per_layer["attn.merge:all_gather"] == 1).all()


@pytest.mark.slow
@pytest.mark.parametrize("cp", [4, 8])
def test_golden_cp4_cp8(cp: int) -> None:
    run = run_golden(TINY, GOLDEN_DIR, dtype="float32", cp=cp)
    assert run.ok, run.table.to_string()


def test_cli_golden_fp32_all_prompts_match(tmp_path: Path) -> None:
    """The README's main job, end to end: every prompt matches (tokens exact, logits within 1e-3), CSV + meta."""
    res = CliRunner().invoke(app, ["golden", "--out", str(tmp_path)])
    assert res.exit_code == 0, res.output
    (run_dir,) = tmp_path.iterdir()
    table = pd.read_csv(run_dir / "golden.csv")
    assert list(table.columns[:6]) == ["prompt", "kind", "prompt_len", "tokens_matched", "tokens_total",
                                       "first_divergent_step"]
    assert len(table) >= 9
    assert (table["verdict"] == "match").all(), table.to_string()
    assert (table["tokens_matched"] == table["tokens_total"]).all()
    assert table["max_abs_dlogit"].max() < 1e-3
    assert f"{len(table)}/{len(table)} prompts match" in res.output
    meta = json.loads((run_dir / "meta.json").read_text())
    assert meta["config_hash"] == ModelConfig.from_json(TINY).config_hash()
    assert "git_sha" in meta and "env" in meta


def test_golden_of_another_format_is_refused(tmp_path: Path) -> None:
    for f in ("golden.json", "golden.safetensors"):
        shutil.copy(GOLDEN_DIR / f, tmp_path / f)
    meta = json.loads((tmp_path / "golden.json").read_text())
    meta["format_version"] = 99
    (tmp_path / "golden.json").write_text(json.dumps(meta))
    with pytest.raises(GoldenError, match="make_golden.py"):
        load_golden(tmp_path, ModelConfig.from_json(TINY))


def test_golden_for_another_config_is_refused(tmp_path: Path) -> None:
    other = ModelConfig(**{**ModelConfig.from_json(TINY).__dict__, "index_topk": 8})
    with pytest.raises(GoldenError, match="made for config"):
        load_golden(GOLDEN_DIR, other)


def test_cli_user_errors_are_one_clear_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from deepinfer_bench.cli import main

    for argv, expect in ((["golden", "--model-dir", str(tmp_path)], "no config.json"),
                         (["golden", "--cp", "3"], "cp=3 does not divide n_routed_experts=8")):
        with pytest.raises(SystemExit) as ex:
            import sys

            old, sys.argv = sys.argv, ["deepinfer", *argv]
            try:
                main()
            finally:
                sys.argv = old
        assert ex.value.code == 2
        err = capsys.readouterr().err
        assert expect in err.replace("\n", " ") and "Traceback" not in err


@pytest.mark.parametrize("mode", ["layer", "regions"])
def test_golden_in_region_graph_modes(monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    """Region graph modes (static-shape decode, uncompiled so it stays fast) give the golden tokens too."""
    from engine.envs import get_envs

    monkeypatch.setenv("DEEPINFER_NEURON_GRAPH_MODE", mode)
    monkeypatch.setenv("DEEPINFER_HOST_COMPILER", "none")
    get_envs.cache_clear()
    try:
        run = run_golden(TINY, GOLDEN_DIR, dtype="float32", cp=1)
    finally:
        monkeypatch.undo()
        get_envs.cache_clear()
    assert run.ok, run.table.to_string()
    assert (run.table["tokens_matched"] == run.table["tokens_total"]).all()
    assert run.meta["graph_mode"] == mode and run.meta["region_launches"] > 0  # decode really ran as regions
