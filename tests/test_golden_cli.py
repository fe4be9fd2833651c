"""`deepinfer golden` end to end on the committed tiny model and golden data (independent HF reference)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pandas as pd
import pytest
from typer.testing import CliRunner

from deepinfer_bench.bench.golden import (
    GOLDEN_DIR,
    collectives_per_layer,
    golden_config,
    load_golden,
    run_golden,
)
from deepinfer_bench.cli import app
from deepinfer_bench.errors import GoldenError
from engine.config import ModelConfig

TINY = GOLDEN_DIR / "tiny"


@pytest.mark.heavy  # graph compiles / ranks: CI runs `-m heavy` beside the default run (docs/ci.md)
def test_golden_cp2_chunked_prefill_matches_with_one_moe_allgather_per_layer() -> None:
    run = run_golden(golden_config(cp=2, max_num_batched_tokens=37), GOLDEN_DIR)
    assert run.ok, run.table.to_string()
    per_layer = collectives_per_layer(run.collectives, run.steps)
    assert (per_layer["moe.exchange:all_gather"] == 1).all()
    assert (per_layer["moe.combine:all_reduce"] == 1).all()
    assert (per_layer["attn.merge:all_gather"] == 1).all()


@pytest.mark.slow
@pytest.mark.parametrize("cp", [4, 8])
def test_golden_cp4_cp8(cp: int) -> None:
    run = run_golden(golden_config(cp=cp), GOLDEN_DIR)
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
    assert meta["engine_config"]["model_config_hash"] == ModelConfig.from_json(TINY).config_hash()
    assert meta["engine_config"]["max_num_seqs"] == len(table)  # every prompt at once by default
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
    from tests.cli import run_main

    for argv, expect in ((["golden", "--model-dir", str(tmp_path)], "no config.json"),
                         (["golden", "--cp", "3"], "cp=3 does not divide n_routed_experts=8"),
                         (["golden", "--cp", "0"], "Invalid value for '--cp'"),  # Typer's own range check
                         (["golden", "--no-such-option"], "No such option: --no-such-option"),
                         (["generate", "--prompt-ids", "1", "--max-tokens", "-1"], "Invalid value for '--max-tokens'"),
                         (["generate", "--prompt-ids", "1", "--prompt", "x"], "exactly one of --prompt"),
                         (["golden", "--backend", "xla", "--kernels", "host"], "does not run on --backend xla"),
                         (["kernels", "--kernel", "nope"], "expected one of")):
        code, _, err = run_main(argv, capsys)
        assert code == 2, argv
        errors = [ln for ln in err.splitlines() if ln.startswith("error:")]
        assert len(errors) == 1 and expect in errors[0] and "Traceback" not in err, err


@pytest.mark.heavy  # graph compiles / ranks: CI runs `-m heavy` beside the default run (docs/ci.md)
@pytest.mark.parametrize("mode", ["layer", "regions"])
def test_golden_in_region_graph_modes(mode: str) -> None:
    """Region graph modes (static-shape decode, uncompiled so it stays fast) give the golden tokens too."""
    run = run_golden(golden_config(graph_mode=mode, host_compiler="none"), GOLDEN_DIR)
    assert run.ok, run.table.to_string()
    assert (run.table["tokens_matched"] == run.table["tokens_total"]).all()
    assert run.meta["graph_mode"] == mode and run.meta["region_launches"] > 0  # decode really ran as regions


def test_golden_under_tight_scheduler_limits_queues_chunks_and_preempts() -> None:
    """3 slots, 24 tokens per step, a pool that cannot hold the batch: requests wait, prefills are chunked next to
    running decodes, the newest get preempted and recomputed - and every token and logit still matches."""
    run = run_golden(golden_config(max_num_seqs=3, max_num_batched_tokens=24, num_kv_blocks=26), GOLDEN_DIR)
    assert run.ok, run.table.to_string()
    assert run.meta["preemptions"] > 0 and run.steps > 150


def test_cli_golden_takes_the_shared_engine_options(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import deepinfer_bench.bench.golden as G

    seen = {}

    def fake_run(config, golden_dir=None, progress=False, **kw):
        seen["config"] = config
        raise SystemExit(0)

    monkeypatch.setattr(G, "run_golden", fake_run)
    res = CliRunner().invoke(app, ["golden", "--max-num-seqs", "3", "--max-num-batched-tokens", "48", "--graph-mode",
                                   "layer", "--backend", "host", "--dtype", "bfloat16", "--num-kv-blocks", "40",
                                   "--out", str(tmp_path)])
    assert res.exit_code == 0, res.output
    c = seen["config"]
    assert (c.cache.max_num_seqs, c.cache.max_num_batched_tokens, c.cache.num_kv_blocks) == (3, 48, 40)
    assert str(c.graph.mode) == "layer" and str(c.backend) == "host" and str(c.model.dtype) == "bfloat16"
    assert c.cache.max_model_len == max(p["prompt_len"] + len(p["output_ids"])
                                        for p in json.loads((GOLDEN_DIR / "golden.json").read_text())["prompts"])
    # chunk graphs: opt in / out from the command line, buckets as a comma list
    res = CliRunner().invoke(app, ["golden", "--graph-mode", "layer", "--chunk-graphs", "--chunk-buckets", "16,64",
                                   "--out", str(tmp_path)])
    assert res.exit_code == 0, res.output
    assert seen["config"].graph.chunk_graphs is True and seen["config"].graph.chunk_buckets == (16, 64)
    res = CliRunner().invoke(app, ["golden", "--backend", "xla", "--graph-mode", "layer", "--no-chunk-graphs",
                                   "--out", str(tmp_path)])
    assert res.exit_code in (0, 2), res.output  # 2: torch-xla is not in this venv (checked before run_golden)
    if res.exit_code == 0:
        assert seen["config"].graph.chunk_graphs is False
