"""`deepinfer kernels`: the command passes its options to the library and exits non-zero on a failure."""

from __future__ import annotations

import pandas as pd
from typer.testing import CliRunner

import deepinfer_bench.bench.kernels as lib
from deepinfer_bench.bench.kernels import COLUMNS
from deepinfer_bench.cli import app

runner = CliRunner()


def _df(ok: bool) -> pd.DataFrame:
    row = dict(kernel="rmsnorm", case="c", shapes="x[1,1]", dtype="float32", executor="stand-in", max_abs_err=0.0,
               max_rel_err=0.0, tol="rtol=0.001 atol=0.0001", time_ms=1.0, note="")
    row["pass"] = ok
    return pd.DataFrame([row], columns=COLUMNS)


def test_options_reach_the_library_and_header_is_honest(monkeypatch, tmp_path):
    seen = {}

    def fake(kernel, executor, *, simulator, include_slow):
        seen.update(kernel=kernel, executor=executor, simulator=simulator, include_slow=include_slow)
        return _df(True)

    monkeypatch.setattr(lib, "run_kernels", fake)
    r = runner.invoke(app, ["kernels", "--kernel", "rmsnorm", "--executor", "stand-in", "--out", str(tmp_path)])
    assert r.exit_code == 0, r.output
    assert seen == {"kernel": "rmsnorm", "executor": "stand-in", "simulator": False, "include_slow": False}
    assert "kernel logic verified on the NumPy stand-in (not compiled)" in r.output
    csvs = list(tmp_path.glob("kernels-*/kernels.csv"))
    assert len(csvs) == 1 and (csvs[0].parent / "meta.json").exists()


def test_failure_exits_nonzero(monkeypatch):
    monkeypatch.setattr(lib, "run_kernels", lambda *a, **k: _df(False))
    r = runner.invoke(app, ["kernels"])
    assert r.exit_code == 1


def test_unavailable_executor_is_refused(capsys):
    from tests.cli import run_main

    for argv, expect in ((["kernels", "--executor", "neuron"], "needs the real `nki`"),
                         (["kernels", "--executor", "gpu"], "--executor 'gpu': expected one of"),
                         (["kernels", "--kernel", "nope"], "--kernel 'nope': expected one of")):
        code, _, err = run_main(argv, capsys)
        assert code == 2 and expect in err and len(err.strip().splitlines()) == 1, err


def test_real_run_one_family():
    df = lib.run_kernels("swiglu", "stand-in")
    assert list(df.columns) == COLUMNS and len(df) >= 10 and df["pass"].all()
    assert set(df["executor"]) == {"stand-in"}
