"""The first hour on a trn2 machine: which kernels compile, and do stand-in, simulator and device agree?

Run through `scripts/trn2_check.sh` (it exports NEURON_PLATFORM_TARGET_OVERRIDE=trn2 and
NEURON_LOGICAL_NC_CONFIG; this module reads no environment):

    scripts/trn2_check.sh [OUT_DIR] [--kernel NAME] [--slow] [--lnc 2] [--no-device]

For every case of every kernel family it runs the wrapper once on the stand-in while recording the exact kernel
operands, then replays each recorded kernel call on the official simulator (`nki.simulate`) and on the device
(`nki.jit` with NumPy arrays compiles a NEFF and runs it), and diffs the three per element. It also checks the
stand-in result against the torch reference (the case verdict of `deepinfer kernels`). One row per kernel call
goes into `<OUT_DIR>/trn2_check.csv` and `trn2_check.json`, with the first line of any compile/run error, so a
failure in one kernel never hides the others.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
import traceback
from pathlib import Path

import numpy as np


def _as_tuple(x):
    return tuple(np.asarray(a) for a in x) if isinstance(x, (tuple, list)) else (np.asarray(x),)


def _diff(a, b) -> float:
    if a is None or b is None:
        return float("nan")
    worst = 0.0
    for x, y in zip(a, b, strict=True):
        if x.shape != y.shape:
            return float("inf")
        xf, yf = x.astype(np.float64), y.astype(np.float64)
        if xf.size:
            worst = max(worst, float(np.nanmax(np.abs(xf - yf))) if np.isfinite(xf).all() and
                        np.isfinite(yf).all() else float("inf"))
    return worst


def _run(kernel, executor: str, args, lnc: int):
    t0 = time.perf_counter()
    try:
        out = _as_tuple(kernel.run(executor, *args, lnc=lnc))
        return out, "ok", (time.perf_counter() - t0) * 1e3
    except Exception as e:  # compile or runtime failure: keep going, report it
        last = traceback.format_exception_only(type(e), e)[-1].strip()
        return None, f"{type(e).__name__}: {last}"[:300], (time.perf_counter() - t0) * 1e3


def check(kernel_name: str | None, include_slow: bool, lnc: int, device: bool) -> list[dict]:
    from nki_kernels import _nki, cases, dispatch, registry

    have_real = _nki.real_nki() is not None
    have_dev = have_real and _nki.has_neuron_device() and device
    rows = []
    names = [kernel_name] if kernel_name else list(registry.KERNELS)
    for name in names:
        mod = registry.load(name)
        for c in mod.CASES:
            if c.slow and not include_slow:
                continue
            with dispatch.record() as calls:
                try:
                    run = mod.run_case(c, "stand-in")
                    verdict = cases.compare(run, *c.tol)
                    ref_ok, ref_err = verdict.ok, verdict.max_abs_err
                except Exception as e:  # the wrapper itself failed on the stand-in
                    rows.append({"kernel": name, "case": c.name, "dtype": c.dtype, "call": "-",
                                 "standin_vs_reference_ok": False, "error": f"{type(e).__name__}: {e}"[:300]})
                    continue
            for i, (call_name, kern, args) in enumerate(calls):
                si, si_status, si_ms = _run(kern, "stand-in", args, 1)
                sim, sim_status, sim_ms = (_run(kern, "simulator", args, lnc) if have_real
                                           else (None, "skipped: real nki absent", 0.0))
                dev, dev_status, dev_ms = (_run(kern, "neuron", args, lnc) if have_dev
                                           else (None, "skipped: no device", 0.0))
                rows.append({
                    "kernel": name, "case": c.name, "dtype": c.dtype, "call": f"{call_name}#{i}",
                    "standin_vs_reference_ok": ref_ok, "standin_vs_reference_max_abs": ref_err,
                    "simulator": sim_status, "device": dev_status,
                    "max_abs_standin_vs_sim": _diff(si, sim), "max_abs_standin_vs_device": _diff(si, dev),
                    "max_abs_sim_vs_device": _diff(sim, dev),
                    "standin_ms": si_ms, "simulator_ms": sim_ms, "device_ms": dev_ms, "standin_status": si_status,
                })
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--kernel", default=None)
    ap.add_argument("--slow", action="store_true", help="include the cases marked slow")
    ap.add_argument("--lnc", type=int, default=1, help="launch kernel[lnc]; must equal NEURON_LOGICAL_NC_CONFIG "
                    "(1: the kernels do not split work by program id; scripts/trn2_check.sh exports and passes it)")
    ap.add_argument("--no-device", action="store_true", help="simulator only")
    a = ap.parse_args(argv)
    import pandas as pd

    from nki_kernels import _nki

    real = _nki.real_nki()
    rows = check(a.kernel, a.slow, a.lnc, not a.no_device)
    df = pd.DataFrame(rows)
    a.out.mkdir(parents=True, exist_ok=True)
    df.to_csv(a.out / "trn2_check.csv", index=False)
    meta = {"real_nki": getattr(real[0], "__version__", "present") if real else None,
            "device": _nki.has_neuron_device(), "lnc": a.lnc, "host": platform.node(),
            "cases": int(df[["kernel", "case", "dtype"]].drop_duplicates().shape[0]) if len(df) else 0}
    (a.out / "trn2_check.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1, default=str))
    if len(df):
        summary = df.groupby("kernel").agg(calls=("call", "size"),
                                           reference_ok=("standin_vs_reference_ok", "all"),
                                           sim_ok=("simulator", lambda s: int((s == "ok").sum())),
                                           dev_ok=("device", lambda s: int((s == "ok").sum())),
                                           worst_sim_diff=("max_abs_standin_vs_sim", "max"),
                                           worst_dev_diff=("max_abs_standin_vs_device", "max"))
        print(summary.to_string())
    print(f"meta: {meta}\nwrote {a.out / 'trn2_check.csv'}")
    bad = len(df) == 0 or not df["standin_vs_reference_ok"].all() or \
        (real is not None and (df["simulator"] != "ok").any())
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
