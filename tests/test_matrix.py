"""`deepinfer bench matrix`: the library over the fake runner, and the command with the library stubbed."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd
import pytest
from typer.testing import CliRunner

from deepinfer_bench.bench import matrix as M
from tests.fake_runner import FakeRunner, fake_config

TINY = Path(__file__).resolve().parents[1] / "golden" / "tiny"


def _config(spec: M.MatrixSpec, **overrides):
    """The engine config the command builds for `spec`, over the fake runner's model."""
    from engine.config import EngineConfig

    workload, fixed = M.engine_sizing(spec)
    model = fake_config(max_model_len=workload.max_model_len).model.config  # its max_position_embeddings fit
    return EngineConfig.from_model_config(model, workload=workload, **{**fixed, **overrides})

REQUIRED = ["batch_size", "input_len", "output_len", "ttft_ms_p50", "ttft_ms_p90", "tpot_ms_p50", "tpot_ms_p90",
            "e2e_ms_p50", "prefill_tok_s", "decode_tok_s", "kv_blocks_used", "status", "skip_reason"]


@pytest.mark.parametrize("name", ["quick", "trn2"])
def test_shipped_matrices_parse_and_fit(name):
    spec = M.MatrixSpec.from_toml(M.resolve_matrix(name))
    assert spec.name == name and spec.cells
    cfg = _config(spec)
    assert cfg.cache.max_num_seqs == max(spec.batch_size)
    assert cfg.cache.block_size == 16 if spec.block_size is None else spec.block_size
    assert all(not M.skip_reason(cfg, *c) for c in spec.cells), "a shipped matrix should fit its own engine"


def test_matrix_spec_errors(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("batch_size = [1]\ninput_len = [8]\noutput_len = [4]\nrepeat = 3\n")
    with pytest.raises(ValueError, match="unknown keys repeat"):
        M.MatrixSpec.from_toml(bad)
    with pytest.raises(ValueError, match="batch_size"):
        M.MatrixSpec(name="x", batch_size=(0,), input_len=(1,), output_len=(1,))
    with pytest.raises(FileNotFoundError, match="quick"):
        M.resolve_matrix("no-such-matrix")


def test_run_matrix_over_fake_runner(tmp_path):
    spec = M.MatrixSpec(name="t", batch_size=(1, 3, 8), input_len=(10, 40), output_len=(5,), warmup=1, repeats=2,
                        warmup_output_len=2, block_size=16, num_kv_blocks=12)
    cfg = _config(spec, max_num_batched_tokens=64)
    assert (cfg.cache.max_num_seqs, cfg.cache.max_model_len, cfg.cache.num_kv_blocks) == (8, 45, 12)
    calls = []
    df = M.run_matrix(spec, cfg, runner=FakeRunner(8, 12, 16, 45, step_delay_s=0.001),
                      progress=lambda done, total, label: calls.append((done, total, label)))
    assert list(df.columns) == M.COLUMNS and set(REQUIRED) <= set(df.columns)
    assert len(df) == len(spec.cells) == 6
    assert calls[0] == (0, 6, "batch=1 in=10 out=5") and calls[-1] == (6, 6, "")
    ok = df[df.status == "ok"]
    skipped = df[df.status == "skipped"]
    # 8 x ceil(45 / 16) = 24 blocks > 12: skipped with the reason; 3 x 3 = 9 fits.
    assert list(zip(skipped.batch_size, skipped.input_len, strict=True)) == [(8, 40)]
    assert "needs 24 KV blocks" in skipped.skip_reason.iloc[0]
    for r in ok.itertuples():
        assert r.ttft_ms_p50 > 0 and r.ttft_ms_p90 >= r.ttft_ms_p50 and r.tpot_ms_p90 >= r.tpot_ms_p50 > 0
        assert r.e2e_ms_p50 >= r.ttft_ms_p50
        assert r.decode_tok_s == pytest.approx(r.batch_size / (r.tpot_ms_p50 / 1e3))
        assert r.prefill_tok_s == pytest.approx(r.batch_size * r.input_len / (r.ttft_ms_p50 / 1e3))
        # The last token is sampled but never fed: input_len + output_len - 1 positions per sequence.
        assert r.kv_blocks_used == r.batch_size * math.ceil((r.input_len + r.output_len - 1) / 16)
        assert r.repeats == 2 and r.skip_reason == ""
    # TPOT excludes the first token: pure-decode steps after TTFT (budget 64 >= 8 x 10, so 1 prefill step).
    pt = M.pivot(df, "tpot_ms_p50")
    assert list(pt) == [5] and list(pt[5].columns) == ["batch_size", "in=10", "in=40"]
    assert pt[5]["batch_size"].tolist() == [1, 3, 8] and math.isnan(pt[5]["in=40"].iloc[2])
    png = M.save_plot(df, tmp_path / "m.png", title="t")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_run_matrix_records_runtime_errors_and_goes_on():
    class Failing(FakeRunner):
        def execute(self, batch):
            if sum(n for _, n in batch) > 40:
                raise RuntimeError("out of device memory")
            return super().execute(batch)

    spec = M.MatrixSpec(name="e", batch_size=(1, 4), input_len=(16,), output_len=(3,), warmup=0, repeats=1,
                        block_size=16)
    cfg = _config(spec)
    df = M.run_matrix(spec, cfg, runner=Failing(4, cfg.cache.num_kv_blocks, 16, cfg.cache.max_model_len))
    assert df.status.tolist() == ["ok", "error"]
    assert df.skip_reason.iloc[1] == "RuntimeError: out of device memory"


def _fake_df(spec) -> pd.DataFrame:
    rows = [M.Row(b, i, o, ttft_ms_p50=1.0, ttft_ms_p90=2.0, tpot_ms_p50=0.5, tpot_ms_p90=0.6, e2e_ms_p50=9.0,
                  e2e_ms_p90=9.5, prefill_tok_s=10.0, decode_tok_s=2.0, kv_blocks_used=b, repeats=2)
            for b, i, o in spec.cells]
    rows[-1].status, rows[-1].skip_reason = "skipped", "needs 99 KV blocks"
    return pd.DataFrame([r.__dict__ for r in rows], columns=M.COLUMNS)


def test_cli_matrix_builds_config_and_writes_results(tmp_path, monkeypatch):
    from deepinfer_bench.cli import app

    seen = {}

    def fake_run_matrix(spec, config, *, runner=None, progress=None):
        seen["spec"], seen["config"] = spec, config
        progress(0, len(spec.cells), "x")
        return _fake_df(spec)

    monkeypatch.setattr(M, "run_matrix", fake_run_matrix)
    res = CliRunner().invoke(app, ["bench", "matrix", "--matrix", "quick", "--model-dir", str(TINY),
                                   "--cp", "2", "--out", str(tmp_path / "out"), "--num-kv-blocks", "77"])
    assert res.exit_code == 0, res.output
    spec, cfg = seen["spec"], seen["config"]
    assert spec.name == "quick"
    assert cfg.cp == 2 and cfg.cache.num_kv_blocks == 77 and cfg.model.model_dir == str(TINY)
    assert cfg.cache.max_num_seqs == max(spec.batch_size) and cfg.cache.block_size == 128  # quick.toml's
    (csv,) = (tmp_path / "out").glob("matrix-quick-*/matrix-quick.csv")
    df = pd.read_csv(csv)
    assert set(REQUIRED) <= set(df.columns) and len(df) == len(spec.cells)
    meta = json.loads((csv.parent / "meta.json").read_text())
    assert meta["matrix"] == "quick" and meta["engine_config"]["num_kv_blocks"] == 77
    assert meta["measured_on"] == "host CPU (torch)"
    assert csv.with_suffix(".png").exists()
    assert "TTFT p50 ms, out=16" in res.output and "TPOT p50 ms, out=16" in res.output
    # A second run never overwrites the first.
    assert CliRunner().invoke(app, ["bench", "matrix", "--out", str(tmp_path / "out")]).exit_code == 0
    assert len(list((tmp_path / "out").glob("matrix-quick-*/matrix-quick.csv"))) == 2


def test_cli_matrix_on_xla_is_labelled_pjrt_cpu(tmp_path, monkeypatch):
    """Numbers of the xla backend on PJRT CPU say so in every table title, the plot and meta.json."""
    import engine.envs
    from deepinfer_bench.cli import app

    monkeypatch.delenv("PJRT_DEVICE", raising=False)  # the backend's default: PJRT CPU
    engine.envs.get_envs.cache_clear()
    monkeypatch.setattr(M, "run_matrix", lambda spec, config, *, runner=None, progress=None: _fake_df(spec))
    res = CliRunner().invoke(app, ["bench", "matrix", "--backend", "xla", "--out", str(tmp_path)])
    assert res.exit_code == 0, res.output
    label = "xla (the PyTorch/XLA lane) on PJRT CPU (not trn2 numbers)"
    assert f"TTFT p50 ms, out=16 ({label})" in " ".join(res.output.split())  # titles wrap
    (csv,) = tmp_path.glob("matrix-quick-*/matrix-quick.csv")
    assert json.loads((csv.parent / "meta.json").read_text())["measured_on"] == label
    monkeypatch.setenv("PJRT_DEVICE", "NEURON")
    engine.envs.get_envs.cache_clear()
    from engine.backends import measured_on

    # the neuron backend's label says what the stack probe finds (here: no SDK), never "on a Neuron device" unprobed
    label = measured_on("neuron")
    assert label.startswith("nothing of TorchNeuron") and "no result is from trn2" in label
    assert "not neuronx-cc, not trn2" in measured_on("neuron-standin")
    engine.envs.get_envs.cache_clear()


def test_cli_matrix_unknown_matrix_is_a_clean_error(tmp_path):
    from deepinfer_bench.cli import app

    res = CliRunner().invoke(app, ["bench", "matrix", "--matrix", "nope", "--out", str(tmp_path)])
    assert res.exit_code == 2 and "no matrix named 'nope'" in res.output


def test_matrices_dir_is_repo_matrices():
    assert M.MATRICES_DIR == Path(__file__).resolve().parents[1] / "matrices"
