"""`deepinfer serve` / `deepinfer bench serve` command wiring (CliRunner), the bench against a live server."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pandas as pd
import pytest
from typer.testing import CliRunner

from deepinfer_bench.bench.serve_sweep import COLUMNS, load_serve_matrix
from deepinfer_bench.cli import app
from deepinfer_bench.server import serve as serving
from engine.config import ModelConfig

TINY = Path(__file__).resolve().parents[2] / "golden" / "tiny"

runner = CliRunner()


def test_serve_builds_config_and_binds_loopback(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict = {}
    monkeypatch.setattr(serving, "serve", lambda config, options, say: seen.update(config=config, options=options))
    r = runner.invoke(app, ["serve", "--num-kv-blocks", "32", "--max-model-len", "1024", "--cp", "1",
                            "--api-key", "k", "--served-model-name", "m", "--backend", "host"])
    assert r.exit_code == 0, r.output
    cfg, opts = seen["config"], seen["options"]
    assert cfg.cache.num_kv_blocks == 32 and cfg.cache.max_model_len == 1024 and cfg.cp == 1
    assert cfg.backend == "host" and cfg.cache.max_num_seqs == 32  # serve's default batch
    assert Path(cfg.model.model_dir).name == "tiny" and opts.served_model_name == "m" and opts.api_key == "k"
    assert opts.host == "127.0.0.1" and opts.port == 8000 and opts.engine_process is True
    assert opts.drain_timeout_s == 5.0  # the documented default
    r = runner.invoke(app, ["serve", "--drain-timeout", "0.5", "--port", "0", "--backend", "host"])
    assert r.exit_code == 0 and seen["options"].drain_timeout_s == 0.5 and seen["options"].port == 0, r.output
    r = runner.invoke(app, ["serve", "--dtype", "float16", "--backend", "host"])
    assert r.exit_code != 0 and "dtype" in r.output
    r = runner.invoke(app, ["serve", "--cp", "2", "--backend", "host"])
    assert r.exit_code == 0 and seen["config"].cp == 2 and seen["options"].engine_process is True, r.output
    r = runner.invoke(app, ["serve", "--cp", "2", "--engine-thread", "--backend", "host"])
    assert r.exit_code != 0 and "--cp" in r.output
    help_text = runner.invoke(app, ["serve", "--help"], env={"COLUMNS": "200"}).output
    assert "--drain-timeout" in help_text and "SIGTERM" in help_text


def test_serving_engine_sets_up_its_process_through_the_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    """serving.build_serving_engine -> engine.build: the config's backend sets the process up (threads, runtime
    env) before the weights load; the fixed pool comes from the config."""
    import engine.backends
    import engine.launch
    from engine.config import EngineConfig

    calls: list = []

    class Backend:
        name, device = "host", "cpu"

        def setup_process(self, threads=None, rank=0):
            calls.append(("setup", threads, rank))

    monkeypatch.setattr(engine.backends, "get_backend", lambda config: Backend())
    monkeypatch.setattr(engine.launch, "build_runner", lambda config, par=None, weights=None, backend=None:
                        calls.append("runner")
                        or type("R", (), {"max_num_seqs": 32, "num_kv_blocks": 24, "block_size": 16,
                                          "max_model_len": 4096})())
    cfg = EngineConfig.from_model_dir(TINY, num_kv_blocks=24)
    eng = serving.build_serving_engine(cfg)
    assert eng.config.cache.num_kv_blocks == 24 and calls[0][0] == "setup" and calls[1] == "runner"


def test_tokenizer_root(tmp_path: Path) -> None:
    official, hf, bare = tmp_path / "official", tmp_path / "hf", tmp_path / "bare"
    for d in (official, hf, bare):
        d.mkdir()
    for d in (official, hf):
        (d / "tokenizer.json").write_text("{}")
        (d / "tokenizer_config.json").write_text('{"tokenizer_class": "PreTrainedTokenizerFast"}')
    shutil.copy(TINY / "config.json", official / "config.json")  # official spelling: no model_type
    (hf / "config.json").write_text('{"model_type": "deepseek_v4"}')
    root = serving.tokenizer_root(official)
    assert root != official
    assert sorted(p.name for p in root.iterdir()) == ["config.json", "tokenizer.json", "tokenizer_config.json"]
    hf_cfg = json.loads((root / "config.json").read_text())  # the HF spelling of the same model, for clients
    assert hf_cfg["model_type"] == "deepseek_v4"
    assert ModelConfig.from_dict(hf_cfg) == ModelConfig.from_json(official)
    assert serving.tokenizer_root(official) == root  # stable
    assert serving.tokenizer_root(hf) == hf.resolve() and serving.tokenizer_root(bare) == bare.resolve()


def test_serve_quick_matrix_parses() -> None:
    m = load_serve_matrix("serve_quick")
    assert m.concurrency and m.input_len and m.output_len and len(m.cells) >= 4
    with pytest.raises(FileNotFoundError, match="no serve matrix named 'no_such_matrix'"):
        load_serve_matrix("no_such_matrix")


def test_bench_serve_command(live_server: str, tmp_path: Path) -> None:
    mpath = tmp_path / "tiny_sweep.toml"
    mpath.write_text("concurrency = [1, 3]\ninput_len = [5]\noutput_len = [4]\nmin_prompts = 3\n"
                     "prompts_per_concurrency = 1\ntoken_id_high = 200\n")
    offline = tmp_path / "offline.csv"
    pd.DataFrame({"batch_size": [1, 3], "input_len": [5, 5], "output_len": [4, 4], "ttft_ms_p50": [1.0, 2.0],
                  "tpot_ms_p50": [1.0, 1.0]}).to_csv(offline, index=False)
    r = runner.invoke(app, ["bench", "serve", "--base-url", f"{live_server}/v1", "--matrix", str(mpath),
                            "--out", str(tmp_path / "out"), "--compare", str(offline)])
    assert r.exit_code == 0, r.output
    (csv,) = (tmp_path / "out").glob("serve-tiny_sweep-*/serve-tiny_sweep.csv")
    df = pd.read_csv(csv)
    assert list(df.columns) == COLUMNS and len(df) == 2 and (df.status == "ok").all()
    assert (csv.parent / "meta.json").exists()
    assert (csv.parent / "serve-tiny_sweep-pareto.png").read_bytes()[:4] == b"\x89PNG"
    assert "online / offline" in r.output


def test_bench_serve_variants_and_chat_trace(live_server: str, tmp_path: Path) -> None:
    """Two labelled servers (the same one here) swept with a multi-turn chat trace: one CSV with a variant column,
    every turn a request, and the Pareto PNG."""
    mpath = tmp_path / "chat.toml"
    mpath.write_text("concurrency = [1, 2]\ninput_len = [4]\noutput_len = [3]\nmin_prompts = 2\n"
                     "prompts_per_concurrency = 1\ntoken_id_high = 200\nshared_prefix_len = 9\nturns = 3\n")
    r = runner.invoke(app, ["bench", "serve", "--base-url", f"a={live_server}", "--base-url", f"b={live_server}/v1",
                            "--matrix", str(mpath), "--out", str(tmp_path / "out")])
    assert r.exit_code == 0, r.output
    (csv,) = (tmp_path / "out").glob("serve-chat-*/serve-chat.csv")
    df = pd.read_csv(csv)
    assert df["variant"].tolist() == ["a", "a", "b", "b"] and (df.status == "ok").all()
    assert df["completed"].tolist() == [6, 6, 6, 6]  # 2 conversations x 3 turns per cell
    # the prompts grow turn by turn: 9 + 4, 9 + 4 + 3 + 4, 9 + 4 + 3 + 4 + 3 + 4 tokens
    assert df["mean_prompt_tokens"].tolist() == [(13 + 20 + 27) / 3] * 4
    assert (csv.parent / "serve-chat-pareto.png").read_bytes()[:4] == b"\x89PNG"
    assert runner.invoke(app, ["bench", "serve", "--base-url", live_server, "--base-url", live_server,
                               "--matrix", str(mpath), "--out", str(tmp_path / "o2")]).exit_code == 2


@pytest.mark.parametrize("name", ["serve_sweep", "inferencex_8k1k", "chat_multiturn"])
def test_sweep_presets_parse(name: str) -> None:
    m = load_serve_matrix(name)
    assert min(m.concurrency) == 1 and max(m.concurrency) >= 64
    if name == "inferencex_8k1k":
        assert (m.input_len, m.output_len, max(m.concurrency)) == ((8192,), (1024,), 128)
    if name == "chat_multiturn":
        assert m.shared_prefix_len > 0 and m.turns > 1


def test_bench_serve_without_a_server_is_a_clear_error(tmp_path: Path) -> None:
    from tests.server.conftest import free_port

    r = runner.invoke(app, ["bench", "serve", "--base-url", f"http://127.0.0.1:{free_port()}", "--out", str(tmp_path)])
    assert r.exit_code == 2 and "cannot benchmark" in r.output


def test_serve_with_a_bad_model_dir_is_a_clear_error(tmp_path: Path) -> None:
    r = runner.invoke(app, ["serve", "--model-dir", str(tmp_path), "--engine-thread", "--backend", "host"])
    assert r.exit_code == 2 and "no config.json" in r.output
