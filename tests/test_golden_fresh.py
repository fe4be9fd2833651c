"""The main job gives the same verdict in every fresh process: `deepinfer golden` (fp32, the README's first command)
run in N new processes must print 12/12 every time, under the pinned reproducible host math. A BLAS code path
chosen per process once made 1 run in 15 fail (engine/envs.py `pin_reproducible_math`, engine/backends/host.py
`setup_host_process`); a fresh process is the only way to draw that choice again.

Each run is piped at COLUMNS=80, as a user's `| tee` is: its table must be whole (no value cut to an ellipsis) and
its verdict one line. The default run starts 3 processes (~10 s); `python -m pytest -m slow
tests/test_golden_fresh.py` starts 20."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

REPO = Path(__file__).resolve().parents[1]


def _fresh_runs(n: int, tmp_path: Path) -> list[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DEEPINFER_", "MKL_", "OMP_"))}
    env["COLUMNS"] = "80"
    verdicts = []
    for i in range(n):
        res = subprocess.run([sys.executable, "-m", "deepinfer_bench.cli", "golden", "--out", str(tmp_path / str(i))],
                             cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
        text = res.stderr.replace("\n", " ")
        m = re.search(r"(\d+)/(\d+) prompts match.*?max \|dlogit\| ([0-9.e+-]+)", text)
        assert m, f"run {i}: no verdict line (exit {res.returncode}):\n{res.stderr[-2000:]}"
        math = re.search(r"host math (\S+)(?: (\S+))? x(\d+)\)", text)
        assert math, f"run {i}: no host math in the verdict line:\n{res.stderr[-2000:]}"
        if math.group(1) == "mkl":  # x86 torch: MKL must be in its reproducible mode, not the per-process draw
            assert math.group(2) == "AUTO,STRICT", f"run {i}: MKL CNR mode {math.group(2)}, expected AUTO,STRICT"
        verdicts.append(f"{m.group(1)}/{m.group(2)} (max |dlogit| {m.group(3)}, exit {res.returncode})")
        if res.returncode == 0:
            _check_piped_output(res, tmp_path / str(i))
    return verdicts


def _check_piped_output(res: subprocess.CompletedProcess, out: Path) -> None:
    """At 80 columns, piped: the table is whole (no value ends in an ellipsis), the verdict line is one line."""
    assert "…" not in res.stdout and "…" not in res.stderr
    table = pd.read_csv(next(out.glob("golden-*/golden.csv")))
    for name, d in zip(table["prompt"], table["max_abs_dlogit"], strict=True):
        assert name in res.stdout and f"{d:.3e}" in res.stdout
    verdict = [ln for ln in res.stderr.splitlines() if "prompts match" in ln]
    assert len(verdict) == 1 and f"{len(table)}/{len(table)} prompts match" in verdict[0]


def _check(verdicts: list[str]) -> None:
    bad = [v for v in verdicts if not re.match(r"(\d+)/\1 .*exit 0\)$", v)]
    assert not bad, f"{len(bad)} of {len(verdicts)} fresh processes did not match every prompt: {verdicts}"


def test_golden_in_3_fresh_processes(tmp_path: Path) -> None:
    _check(_fresh_runs(3, tmp_path))


@pytest.mark.slow
def test_golden_in_20_fresh_processes(tmp_path: Path) -> None:
    _check(_fresh_runs(20, tmp_path))
