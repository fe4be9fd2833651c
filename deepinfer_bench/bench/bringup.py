"""`deepinfer bringup`: the one command for a new Neuron host (issue 21 item 8; it replaces scripts/trn2_check.sh).

Steps, in order, each a `deepinfer` command in its own process (each sets its own process environment: compile-only
mode, cp ranks) with its output under the report folder:

  probe -> kernels -> compile-only -> golden cp 1 -> golden cp 2 -> golden bf16 -> golden bf16 of --model-dir
  -> regions timing -> quick matrix

* `probe`: the stack (engine/stack.py `probe`, which Neuron stack, a device) and the backend's own availability check
  (`engine.backends.check_available`), in this process;
* `kernels`: every NKI kernel on the device (`deepinfer kernels --executor neuron`), only where the backend runs NKI
  kernels on a Neuron device;
* `compile-only`: `deepinfer compile` of every graph at the compile sizes (TorchNeuron: neuronx-cc in compile-only
  mode; the stand-in: StableHLO lowering and checks);
* `golden cp 1`, `golden cp 2`: `deepinfer golden` (tiny model) on 1 and 2 ranks (cp 2 only where the backend runs
  ranks: `check_parallel`);
* `golden bf16`: `deepinfer golden --dtype bfloat16` (tiny model), teacher-forced and judged by the three-way verdict
  (deepinfer_bench/bench/verdict.py: within the noise band of honest bf16 runs of the HF reference); its reference
  comes from the cache, or `--reference DIR` (made on a CPU box by `deepinfer reference`: a trn2 host needs no
  transformers);
* `golden bf16 of --model-dir`: the same on the model given (a slice of the real weights: `deepinfer slice`), only
  with `--model-dir`;
* `regions timing`: `deepinfer regions --timing`, a short run;
* `quick matrix`: `deepinfer matrix --matrix quick`.

The first failing step stops the run and is named; every later step is listed as "not run" with the reason, and so
is a step that cannot run on this backend (e.g. kernels on the stand-in). One report: `bringup.md` (markdown),
`bringup.csv` (one row per step) and `meta.json`. Per step it keeps what the community V4 port's runbook asks a device
gate to keep (longdct/vllm-neuron docs/model-dev): the command, the Neuron / TorchNeuron / deepinfer environment it
ran under, its full log, the bucket config (the compile step's graph budget), the NEFFs it left (count and bytes,
under the step's folder and the NEFF cache), wall time, host peak RSS (the step's process, from wait4) and device
peak memory (what the step reports in its results as `device_peak_bytes`: `torch.neuron.max_memory_allocated`
of rank 0's core; without a device the results say "not measured: no Neuron device", never 0).
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

STEPS = ("probe", "kernels", "compile-only", "golden-cp1", "golden-cp2", "golden-bf16", "golden-model-bf16", "regions",
         "matrix")
COLUMNS = ["step", "status", "seconds", "exit_code", "command", "reason", "log", "host_peak_rss_mb",
           "device_peak_mb", "neffs", "neff_mb", "buckets", "env"]
# the compile step compiles what the golden steps after it run (compile's default workload)
DEFAULT_COMPILE_SIZES = ("--workload", "golden")
ENV_PREFIXES = ("NEURON_", "TORCH_NEURONX_", "DEEPINFER_", "NKI_", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "WORLD_SIZE")
_PEAK_RSS: dict[str, float] = {}  # log path -> host peak RSS (MiB) of the step's process (run_step)


@dataclass
class Plan:
    """What a bring-up runs: the backend, the model for compile / regions / matrix (golden is always the tiny model
    its data was made for), the compile sizes, the steps skipped by the user."""

    backend: str
    out: Path
    model_dir: str | None = None
    compile_sizes: Sequence[str] = DEFAULT_COMPILE_SIZES
    skip: frozenset[str] = frozenset()
    reference: str | None = None  # the golden bf16 steps' reference cache (deepinfer reference --out DIR)
    cli: Sequence[str] = (sys.executable, "-c", "from deepinfer_bench.cli import main; main()")
    extra: dict[str, Any] = field(default_factory=dict)


def _cannot_run(backend: str, step: str, model_dir: str | None = None) -> str | None:
    """Why `step` cannot run on `backend` (None: it can)."""
    from engine.backends import backend_class

    if step == "golden-model-bf16" and not model_dir:
        return "no --model-dir (the golden of a slice of the real weights: deepinfer slice)"
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
    bf16 = ["--dtype", "bfloat16", *(["--reference", plan.reference] if plan.reference else [])]
    return {
        "kernels": ["kernels", "--executor", "neuron", "--out", str(dirs / "kernels")],
        "compile-only": ["compile", *b, *model, *plan.compile_sizes, "--out", str(dirs / "compile")],
        "golden-cp1": ["golden", *b, "--out", str(dirs / "golden")],
        "golden-cp2": ["golden", *b, "--cp", "2", "--out", str(dirs / "golden")],
        "golden-bf16": ["golden", *b, *bf16, "--out", str(dirs / "golden")],
        "golden-model-bf16": ["golden", *b, *model, *bf16, "--out", str(dirs / "golden-model")],
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
    """One step's command in its own process, stdout + stderr into `log`; its exit code (its peak RSS is kept for
    the report)."""
    import os

    with log.open("w") as f:
        proc = subprocess.Popen(list(argv), stdout=f, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
    _PEAK_RSS[str(log)] = usage.ru_maxrss / 1024  # KiB on Linux
    return proc.returncode


def step_env() -> dict[str, str]:
    """The variables a step runs under that decide what it compiles and where (Neuron, TorchNeuron, deepinfer)."""
    from engine.envs import environ

    return {k: v for k, v in sorted(environ().items()) if k.startswith(ENV_PREFIXES)}


def neff_inventory(*folders: Path, since: float = 0.0) -> tuple[int, float]:
    """(count, MiB) of the .neff files under `folders` written at or after `since` (wall time)."""
    seen: dict[Path, int] = {}
    for folder in folders:
        if folder.is_dir():
            for p in folder.rglob("*.neff"):
                st = p.stat()
                if st.st_mtime >= since:
                    seen[p.resolve()] = st.st_size
    return len(seen), round(sum(seen.values()) / 2**20, 3)


def _step_results(dirs: Path, step: str) -> tuple[str | None, float | None]:
    """(bucket config, device peak MiB) a step wrote: the compile manifest's graph budget; a results meta.json's
    `device_peak_bytes`."""
    import json

    buckets, device = None, None
    folder = dirs / {"compile-only": "compile", "golden-cp1": "golden", "golden-cp2": "golden", "golden-bf16": "golden",
                     "golden-model-bf16": "golden-model"}.get(step, step)
    manifest = folder / "manifest.json"
    if step == "compile-only" and manifest.exists():
        b = json.loads(manifest.read_text()).get("budget") or {}
        if b:
            buckets = (f"batch {b['batch_buckets']} x blocks {b['block_buckets']} x chunks {b['chunk_buckets']}: "
                       f"{b['total']} graphs")
    for meta in sorted(folder.rglob("meta.json")) if folder.is_dir() else []:
        got = json.loads(meta.read_text())
        peak = got.get("device_peak_bytes")
        if peak is not None:
            device = round(peak / 2**20, 3)
        elif isinstance(got.get("device_peak"), str):
            device = got["device_peak"]  # why it is not measured (no Neuron device), never 0
    return buckets, device


def bringup(plan: Plan, runner: Callable[[Sequence[str], Path], int] | None = None,
            progress: Callable[[str, str], None] | None = None) -> tuple[pd.DataFrame, dict[str, Any]]:
    """Run the steps of `plan` in order, stopping at the first failure; (one row per step, meta). `runner` runs one
    command (default `run_step`; a test passes a fake)."""
    runner = runner or run_step
    plan.out.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    failed: str | None = None
    for step in STEPS:
        row: dict[str, Any] = dict.fromkeys(COLUMNS)
        row.update(step=step, status="not run")
        rows.append(row)
        if failed is not None:
            row["reason"] = f"stopped after the failure of {failed}"
            continue
        if step in plan.skip:
            row["reason"] = "skipped (--skip)"
            continue
        why = _cannot_run(plan.backend, step, plan.model_dir)
        if why is not None:
            row["reason"] = why
            continue
        log = plan.out / f"{step}.log"
        row["log"] = str(log)
        if progress is not None:
            progress(step, "running")
        t0, wall0 = time.perf_counter(), time.time()
        row["env"] = " ".join(f"{k}={v}" for k, v in step_env().items())
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
        row["host_peak_rss_mb"] = _PEAK_RSS.pop(str(log), None)
        row["buckets"], row["device_peak_mb"] = _step_results(plan.out, step)
        row["neffs"], row["neff_mb"] = neff_inventory(plan.out, _neff_cache(), since=wall0)
        row["status"] = "pass" if code == 0 else "fail"
        if code != 0:
            failed = step
        if progress is not None:
            progress(step, row["status"])
    df = pd.DataFrame(rows, columns=COLUMNS).astype({"exit_code": "Int64", "neffs": "Int64"})
    meta = {"backend": plan.backend, "model_dir": plan.model_dir, "reference": plan.reference,
            "compile_sizes": list(plan.compile_sizes),
            "skip": sorted(plan.skip), "first_failure": failed, "ok": failed is None,
            "not_run": [r["step"] for r in rows if r["status"] == "not run"], **plan.extra}
    return df, meta


def _peak_cell(v: Any) -> str:
    """Device peak MiB, or why it was not measured."""
    if isinstance(v, str):
        return v
    return "not measured" if v is None or pd.isna(v) else f"{v:.0f}"


def _neff_cache() -> Path:
    """Where TorchNeuron keeps NEFFs: TORCH_NEURONX_NEFF_CACHE_DIR, else this project's cache root (per-rank
    folders under it: engine/backends/torchneuron.py `neff_cache_dir`)."""

    from engine.envs import cache_root, environ

    return Path(environ().get("TORCH_NEURONX_NEFF_CACHE_DIR") or cache_root() / "neff")


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
             "| step | status | seconds | exit | host peak RSS MiB | device peak MiB | NEFFs (MiB) | buckets | "
             "command / reason |", "|---|---|---|---|---|---|---|---|---|"]

    def cell(v: Any, fmt: str = "{}") -> str:
        return "" if v is None or pd.isna(v) else fmt.format(v)

    for r in df.itertuples():
        command = cell(r.command)
        reason = cell(r.reason)
        what = f"{command} - {reason}" if command and reason else command or reason
        code = "" if pd.isna(r.exit_code) else str(int(r.exit_code))
        neffs = "" if pd.isna(r.neffs) else f"{int(r.neffs)} ({r.neff_mb:.1f})"
        lines.append(f"| {r.step} | {r.status} | {cell(r.seconds, '{:.1f}')} | {code} | "
                     f"{cell(r.host_peak_rss_mb, '{:.0f}')} | {_peak_cell(r.device_peak_mb)} | "
                     f"{neffs} | {cell(r.buckets)} | {what.replace('|', '/')} |")
    lines += ["", "Environment of each step and its full log: bringup.csv (`env`, `log`)."]
    return "\n".join(lines) + "\n"
