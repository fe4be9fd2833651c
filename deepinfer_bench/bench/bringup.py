"""`deepinfer bringup`: the one command for a new Neuron host (issue 21 item 8; it replaces scripts/trn2_check.sh).

Steps, in order, each a `deepinfer` command in its own process (each sets its own process environment: compile-only
mode, cp ranks) with its output under the report folder:

  probe -> kernels -> compile-only -> golden cp 1 -> golden cp 2 -> regions timing -> quick matrix

* `probe`: the stack (engine/stack.py `probe`, which Neuron stack, a device) and the backend's own availability check
  (`engine.backends.check_available`), in this process;
* `kernels`: every NKI kernel on the device (`deepinfer kernels --executor neuron`), only where the backend runs NKI
  kernels on a Neuron device;
* `compile-only`: `deepinfer compile` of every graph at the compile sizes (TorchNeuron: neuronx-cc in compile-only
  mode; the stand-in: StableHLO lowering and checks);
* `golden cp 1`, `golden cp 2`: `deepinfer golden` (tiny model) on 1 and 2 ranks (cp 2 only where the backend runs
  ranks: `check_parallel`);
* `regions timing`: `deepinfer regions --timing`, a short run;
* `quick matrix`: `deepinfer matrix --matrix quick`.

The first failing step stops the run and is named; every later step is listed as "not run" with the reason, and so
is a step that cannot run on this backend (e.g. kernels on the stand-in). One report: `bringup.md` (markdown),
`bringup.csv` (one row per step: step, status, seconds, exit code, command, reason, log) and `meta.json`.
"""

from __future__ import annotations

import shlex
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

STEPS = ("probe", "kernels", "compile-only", "golden-cp1", "golden-cp2", "regions", "matrix")
COLUMNS = ["step", "status", "seconds", "exit_code", "command", "reason", "log"]
DEFAULT_COMPILE_SIZES = ("--max-num-seqs", "1", "--max-model-len", "16")


@dataclass
class Plan:
    """What a bring-up runs: the backend, the model for compile / regions / matrix (golden is always the tiny model
    its data was made for), the compile sizes, the steps skipped by the user."""

    backend: str
    out: Path
    model_dir: str | None = None
    compile_sizes: Sequence[str] = DEFAULT_COMPILE_SIZES
    skip: frozenset[str] = frozenset()
    cli: Sequence[str] = (sys.executable, "-c", "from deepinfer_bench.cli import main; main()")
    extra: dict[str, Any] = field(default_factory=dict)


def _cannot_run(backend: str, step: str) -> str | None:
    """Why `step` cannot run on `backend` (None: it can)."""
    from engine.backends import backend_class

    cls = backend_class(backend)
    if step == "kernels" and not (backend == "neuron" and "nki" in cls.kernel_tables):
        return (f"the NKI kernels run on a Neuron device (--backend neuron); {backend} runs "
                f"--kernels {'/'.join(cls.kernel_tables)}")
    if step == "golden-cp2":
        try:
            cls.check_parallel(2)
        except ValueError as e:
            return str(e)
    return None


def _argv(plan: Plan, step: str, dirs: Path) -> list[str]:
    model = ["--model-dir", plan.model_dir] if plan.model_dir else []
    b = ["--backend", plan.backend]
    return {
        "kernels": ["kernels", "--executor", "neuron", "--out", str(dirs / "kernels")],
        "compile-only": ["compile", *b, *model, *plan.compile_sizes, "--out", str(dirs / "compile")],
        "golden-cp1": ["golden", *b, "--out", str(dirs / "golden")],
        "golden-cp2": ["golden", *b, "--cp", "2", "--out", str(dirs / "golden")],
        "regions": ["regions", *b, *model, "--timing", "--batch", "2", "--context", "32", "--steps", "5",
                    "--out", str(dirs / "regions")],
        "matrix": ["bench", "matrix", *b, *model, "--matrix", "quick", "--out", str(dirs / "matrix")],
    }[step]


def probe_step(backend: str, out: Path) -> None:
    """The stack, written to `out` (probe.json), and the backend's availability: raises one line when missing."""
    import json

    from engine.backends import check_available
    from engine.stack import probe

    out.write_text(json.dumps(probe(), indent=1, default=str) + "\n")
    check_available(backend)


def run_step(argv: Sequence[str], log: Path) -> int:
    """One step's command in its own process, stdout + stderr into `log`; its exit code."""
    with log.open("w") as f:
        return subprocess.run(list(argv), stdout=f, stderr=subprocess.STDOUT, check=False).returncode


def bringup(plan: Plan, runner: Callable[[Sequence[str], Path], int] | None = None,
            progress: Callable[[str, str], None] | None = None) -> tuple[pd.DataFrame, dict[str, Any]]:
    """Run the steps of `plan` in order, stopping at the first failure; (one row per step, meta). `runner` runs one
    command (default `run_step`; a test passes a fake)."""
    runner = runner or run_step
    plan.out.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    failed: str | None = None
    for step in STEPS:
        row: dict[str, Any] = {"step": step, "status": "not run", "seconds": None, "exit_code": None,
                               "command": None, "reason": None, "log": None}
        rows.append(row)
        if failed is not None:
            row["reason"] = f"stopped after the failure of {failed}"
            continue
        if step in plan.skip:
            row["reason"] = "skipped (--skip)"
            continue
        why = _cannot_run(plan.backend, step)
        if why is not None:
            row["reason"] = why
            continue
        log = plan.out / f"{step}.log"
        row["log"] = str(log)
        if progress is not None:
            progress(step, "running")
        t0 = time.perf_counter()
        if step == "probe":
            row["command"] = "engine.stack.probe() + engine.backends.check_available"
            try:
                probe_step(plan.backend, plan.out / "probe.json")
                code = 0
            except ValueError as e:
                log.write_text(f"{e}\n")
                row["reason"], code = str(e), 1
        else:
            argv = [*plan.cli, *_argv(plan, step, plan.out)]
            row["command"] = "deepinfer " + shlex.join(argv[len(plan.cli):])
            code = runner(argv, log)
            if code != 0:
                row["reason"] = _last_line(log)
        row["seconds"] = round(time.perf_counter() - t0, 3)
        row["exit_code"] = code
        row["status"] = "pass" if code == 0 else "fail"
        if code != 0:
            failed = step
        if progress is not None:
            progress(step, row["status"])
    df = pd.DataFrame(rows, columns=COLUMNS).astype({"exit_code": "Int64"})
    meta = {"backend": plan.backend, "model_dir": plan.model_dir, "compile_sizes": list(plan.compile_sizes),
            "skip": sorted(plan.skip), "first_failure": failed, "ok": failed is None,
            "not_run": [r["step"] for r in rows if r["status"] == "not run"], **plan.extra}
    return df, meta


def _last_line(log: Path) -> str | None:
    try:
        lines = [ln.strip() for ln in log.read_text(errors="ignore").splitlines() if ln.strip()]
    except OSError:
        return None
    return lines[-1][:300] if lines else None


def markdown(df: pd.DataFrame, meta: dict[str, Any], measured_on: str) -> str:
    """The report: verdict line, what the numbers are, one table row per step."""
    not_run = ", ".join(meta["not_run"]) or "none"
    verdict = (f"every step that ran passed (not run: {not_run})" if meta["ok"]
               else f"stopped: step **{meta['first_failure']}** failed")
    lines = [f"# deepinfer bringup: --backend {meta['backend']}", "", f"{verdict}.", "",
             f"Measured on: {measured_on}.", "",
             "| step | status | seconds | exit | command / reason |", "|---|---|---|---|---|"]
    for r in df.itertuples():
        command = "" if pd.isna(r.command) else r.command
        reason = "" if pd.isna(r.reason) else r.reason
        what = f"{command} - {reason}" if command and reason else command or reason
        secs = "" if pd.isna(r.seconds) else f"{r.seconds:.1f}"
        code = "" if pd.isna(r.exit_code) else str(int(r.exit_code))
        lines.append(f"| {r.step} | {r.status} | {secs} | {code} | {what.replace('|', '/')} |")
    return "\n".join(lines) + "\n"
