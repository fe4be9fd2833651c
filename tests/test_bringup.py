"""`deepinfer bringup` orchestration (deepinfer_bench/bench/bringup.py) with fake steps: the order, what cannot run on a
backend listed as not run with its reason, the first failure stopping the run and named, the one report."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from deepinfer_bench.bench import bringup as B
from tests.cli import run_main


class FakeSteps:
    """Records each command; the step named `fail` exits 1 with a last log line."""

    def __init__(self, fail: str | None = None) -> None:
        self.fail, self.calls = fail, []

    def __call__(self, argv, log: Path) -> int:
        cmd = list(argv[3:])  # after `python -c "...main()"`
        self.calls.append(cmd)
        failing = self.fail is not None and (cmd[0] == self.fail or (self.fail == "golden-cp2" and "--cp" in cmd))
        log.write_text("step output\nerror: NCC_EVRF051 in head_b1\n" if failing else "ok\n")
        return 1 if failing else 0


@pytest.fixture
def probe_ok(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    seen: list[str] = []
    monkeypatch.setattr(B, "probe_step", lambda backend, out: seen.append(backend) or out.write_text("{}"))
    return seen


def test_standin_runs_what_it_can_and_lists_the_rest(tmp_path: Path, probe_ok) -> None:
    steps = FakeSteps()
    df, meta = B.bringup(B.Plan("neuron-standin", tmp_path), steps)
    status = dict(zip(df["step"], df["status"], strict=True))
    assert list(df["step"]) == list(B.STEPS)
    assert status == {"probe": "pass", "kernels": "not run", "compile-only": "pass", "golden-cp1": "pass",
                      "golden-cp2": "not run", "golden-bf16": "pass", "golden-model-bf16": "not run",
                      "regions": "pass", "matrix": "pass"}
    reasons = dict(zip(df["step"], df["reason"], strict=True))
    assert "Neuron device" in reasons["kernels"] and "cp=2 on --backend neuron-standin" in reasons["golden-cp2"]
    assert "no --model-dir" in reasons["golden-model-bf16"]
    assert [c[0] for c in steps.calls] == ["compile", "golden", "golden", "regions", "bench"]
    assert steps.calls[-1][1] == "matrix"
    assert steps.calls[2] == ["golden", "--backend", "neuron-standin", "--dtype", "bfloat16", "--out",
                              str(tmp_path / "golden")]
    assert steps.calls[0] == ["compile", "--backend", "neuron-standin", "--workload", "golden",
                              "--out", str(tmp_path / "compile")]
    assert all(c[c.index("--backend") + 1] == "neuron-standin" for c in steps.calls)
    assert meta["ok"] and meta["first_failure"] is None
    assert meta["not_run"] == ["kernels", "golden-cp2", "golden-model-bf16"]
    assert probe_ok == ["neuron-standin"]


def test_first_failure_stops_and_is_named(tmp_path: Path, probe_ok) -> None:
    steps = FakeSteps(fail="compile")
    df, meta = B.bringup(B.Plan("neuron", tmp_path, model_dir="/m"), steps)
    rows = df.set_index("step")
    assert [c[0] for c in steps.calls] == ["kernels", "compile"]  # on neuron the kernels step runs
    assert steps.calls[0] == ["kernels", "--executor", "neuron", "--out", str(tmp_path / "kernels")]
    assert rows.loc["compile-only", "status"] == "fail" and rows.loc["compile-only", "exit_code"] == 1
    assert rows.loc["compile-only", "reason"] == "error: NCC_EVRF051 in head_b1"  # the log's last line
    for step in ("golden-cp1", "golden-cp2", "golden-bf16", "golden-model-bf16", "regions", "matrix"):
        assert rows.loc[step, "status"] == "not run"
        assert rows.loc[step, "reason"] == "stopped after the failure of compile-only"
    assert not meta["ok"] and meta["first_failure"] == "compile-only"
    md = B.markdown(df, meta, "label")
    assert "stopped: step **compile-only** failed" in md and md.count("\n| ") == 1 + len(B.STEPS)


def test_neuron_runs_cp2_and_a_failing_probe_stops_everything(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             probe_ok) -> None:
    steps = FakeSteps(fail="golden-cp2")
    df, meta = B.bringup(B.Plan("neuron", tmp_path), steps)
    assert ["golden", "--backend", "neuron", "--cp", "2", "--out", str(tmp_path / "golden")] in steps.calls
    assert meta["first_failure"] == "golden-cp2" and list(df["status"])[-4:] == ["not run"] * 4

    def no_device(backend: str, out: Path) -> None:
        raise ValueError("torch-neuronx 2.13.3 (TorchNeuron) is installed but no Neuron device is visible")

    monkeypatch.setattr(B, "probe_step", no_device)
    steps = FakeSteps()
    df, meta = B.bringup(B.Plan("neuron", tmp_path / "2"), steps)
    assert steps.calls == [] and meta["first_failure"] == "probe"
    assert "no Neuron device" in df.iloc[0]["reason"]


def test_cli_writes_one_report(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture,
                               probe_ok) -> None:
    monkeypatch.setattr(B, "run_step", FakeSteps())
    code, _, err = run_main(["bringup", "--backend", "neuron-standin", "--skip", "regions,matrix", "--out",
                             str(tmp_path)], capsys)
    assert code == 0, err
    (run,) = tmp_path.glob("bringup-*")
    df = pd.read_csv(run / "bringup.csv")
    assert list(df["status"]) == ["pass", "not run", "pass", "pass", "not run", "pass", "not run", "not run",
                                  "not run"]
    assert list(df["reason"])[-2:] == ["skipped (--skip)"] * 2
    meta = json.loads((run / "meta.json").read_text())
    assert meta["measured_on"].startswith("TorchNeuron pipeline on a CPU stand-in") and meta["ok"]
    md = (run / "bringup.md").read_text()
    assert "| compile-only | pass |" in md and "nan" not in md and "not run: kernels, golden-cp2, golden-model-bf16, " \
        "regions, matrix" in md
    assert list(df["exit_code"].dropna()) == [0, 0, 0, 0]
    code, _, err = run_main(["bringup", "--skip", "warp", "--out", str(tmp_path)], capsys)
    assert code == 2 and "unknown step(s)" in err


@pytest.mark.parametrize("backend", ["neuron", "neuron-standin"])
def test_every_step_is_a_command_line_the_cli_parses(tmp_path: Path, backend: str) -> None:
    """Each step's argv names a real command (sub-commands included) and every option it passes parses: the fake
    steps above would accept a misspelt command that only fails on the device host."""
    import typer.main

    from deepinfer_bench.cli import app

    plan = B.Plan(backend, tmp_path, model_dir="/m")
    for step in B.STEPS[1:]:
        cmd, args = typer.main.get_command(app), B._argv(plan, step, tmp_path)
        while hasattr(cmd, "commands"):  # a group (Typer vendors its own click: no isinstance check)
            name, args = args[0], args[1:]
            cmd = cmd.commands.get(name)
            assert cmd is not None, f"{step}: no command {name!r}"
        cmd.make_context(step, list(args))  # raises a usage error on an unknown option or a bad value


STEP_SCRIPT = """
import json, pathlib, sys
argv = sys.argv[1:]
out = pathlib.Path(argv[argv.index("--out") + 1])
out.mkdir(parents=True, exist_ok=True)
blob = bytearray(64 * 2**20)  # a step whose peak RSS is above 64 MiB
if argv[0] == "compile":
    (out / "layer_b1_nb1.neff").write_bytes(b"n" * 2**20)
    (out / "manifest.json").write_text(json.dumps({"budget": {"batch_buckets": [1, 2], "block_buckets": [32],
                                                              "chunk_buckets": [], "total": 12}}))
if argv[0] == "golden":
    (out / "run1").mkdir(exist_ok=True)
    (out / "run1" / "meta.json").write_text(json.dumps({"device_peak_bytes": 3 * 2**20}))
print("done", argv[0])
"""


def test_each_step_keeps_what_a_device_gate_keeps(tmp_path: Path, probe_ok, monkeypatch: pytest.MonkeyPatch) -> None:
    """Per step, with the real step runner: command, environment, full log, bucket config, NEFF inventory and sizes,
    wall time, host peak RSS of the step's process, device peak memory where the step reported one."""
    import sys

    monkeypatch.setenv("NEURON_CC_FLAGS", "-O1")
    monkeypatch.setenv("TORCH_NEURONX_NEFF_CACHE_DIR", str(tmp_path / "neffcache"))
    plan = B.Plan("neuron-standin", tmp_path / "run", cli=(sys.executable, "-c", STEP_SCRIPT),
                  skip=frozenset({"regions", "matrix"}))
    df, meta = B.bringup(plan)
    rows = {r["step"]: r for r in df.to_dict("records")}
    comp, gold = rows["compile-only"], rows["golden-cp1"]
    assert comp["status"] == "pass" and comp["command"].startswith("deepinfer compile --backend neuron-standin")
    assert "NEURON_CC_FLAGS=-O1" in comp["env"] and Path(comp["log"]).read_text().strip() == "done compile"
    assert comp["buckets"] == "batch [1, 2] x blocks [32] x chunks []: 12 graphs"
    assert (comp["neffs"], comp["neff_mb"]) == (1, 1.0)
    assert comp["host_peak_rss_mb"] > 64 and comp["seconds"] > 0
    assert gold["device_peak_mb"] == 3.0 and gold["neffs"] == 0  # no new NEFF since it started
    md = B.markdown(df, meta, "x")
    assert "| compile-only | pass |" in md and "1 (1.0)" in md and "not measured" in md


def test_device_peak_off_device_says_why_never_zero(tmp_path: Path) -> None:
    """A golden run without a Neuron device reports why its device peak is not measured; the report shows that
    line, not 0 and not a blank."""
    import json

    (tmp_path / "golden" / "run1").mkdir(parents=True)
    (tmp_path / "golden" / "run1" / "meta.json").write_text(json.dumps(
        {"device_peak_bytes": None, "device_peak": "not measured: no Neuron device"}))
    assert B._step_results(tmp_path, "golden-cp1") == (None, "not measured: no Neuron device")
    (tmp_path / "golden" / "run1" / "meta.json").write_text(json.dumps({"device_peak_bytes": 5 * 2**20,
                                                                       "device_peak": 5 * 2**20}))
    assert B._step_results(tmp_path, "golden-cp1") == (None, 5.0)
    assert B._peak_cell("not measured: no Neuron device") == "not measured: no Neuron device"
    assert B._peak_cell(5.0) == "5" and B._peak_cell(None) == "not measured"
