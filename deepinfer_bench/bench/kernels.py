"""`deepinfer kernels` library: run every case of the NKI kernels and return one row per case (no printing)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import pandas as pd

COLUMNS = ["kernel", "case", "shapes", "dtype", "executor", "max_abs_err", "max_rel_err", "tol", "pass", "time_ms",
           "note"]


@dataclass
class Row:
    kernel: str
    case: str
    shapes: str
    dtype: str
    executor: str
    max_abs_err: float
    max_rel_err: float
    tol: str
    pass_: bool
    time_ms: float
    note: str = ""


def select_cases(kernel: str | None = None, include_slow: bool = False) -> list:
    from nki_kernels import registry

    names = [kernel] if kernel else list(registry.KERNELS)
    out = []
    for name in names:
        out += [c for c in registry.load(name).CASES if include_slow or not c.slow]
    return out


def run_kernels(kernel: str | None = None, executor: str = "auto", *, simulator: bool = False,
                include_slow: bool = False, lnc: int | None = None) -> pd.DataFrame:
    """One row per case: errors vs the torch reference, verdict and wall time of the kernel call, on a dispatcher
    of this run (the process's LNC unless `lnc` is given).

    A case passes only if the kernel ran on the resolved executor (dispatch counter moved) and the reference
    path was not taken in its place."""
    from engine.stack import logical_nc_config
    from nki_kernels import dispatch, registry
    from nki_kernels.cases import compare

    d = dispatch.Dispatcher("auto", simulator=simulator, lnc=lnc or logical_nc_config())
    with d.active():
        return _run_cases(d, kernel, d.resolve(executor), include_slow, compare, registry)


def _run_cases(d: Any, kernel: str | None, ex: str, include_slow: bool, compare: Any, registry: Any) -> pd.DataFrame:
    rows: list[Row] = []
    for c in select_cases(kernel, include_slow):
        mod = registry.load(c.kernel)
        before = dict(d.counts)
        rtol, atol = c.tol
        tol = f"rtol={rtol:g} atol={atol:g}"
        try:
            run = mod.run_case(c, ex)
        except Exception as e:  # a failing case is a row, not a crash
            rows.append(Row(c.kernel, c.name, "", c.dtype, ex, float("nan"), float("nan"), tol, False, float("nan"),
                            f"{type(e).__name__}: {e}"[:200]))
            continue
        v = compare(run, rtol, atol)
        moved = {k: n - before.get(k, 0) for k, n in d.counts.items() if n != before.get(k, 0)}
        ran_kernel = any(k[1] == ex for k in moved) and not any(k[1] == "reference" for k in moved)
        note = v.note if ran_kernel else f"kernel not dispatched on {ex}: {moved}"
        rows.append(Row(c.kernel, c.name, run.shapes, c.dtype, ex, v.max_abs_err, v.max_rel_err, tol,
                        v.ok and ran_kernel, run.time_ms, note))
    df = pd.DataFrame([asdict(r) for r in rows])
    if df.empty:
        return pd.DataFrame(columns=COLUMNS)
    return df.rename(columns={"pass_": "pass"})[COLUMNS]


def resolve_run(kernel: str | None, executor: str) -> tuple[str, bool]:
    """The (executor, simulator) a `deepinfer kernels` run uses: `kernel` checked against the families,
    `executor` auto -> DEEPINFER_KERNEL_EXECUTOR, the NKI simulator when NKI_SIMULATOR=1 was recorded, the
    process's LNC for every launch, the installed NKI version checked for the real executors. A request this
    machine cannot serve (no real NKI, no Neuron device) is a ValueError naming what is missing."""
    from engine.envs import get_envs
    from engine.stack import check_nki_version, versions
    from nki_kernels import dispatch
    from nki_kernels.registry import KERNELS

    if kernel is not None and kernel not in KERNELS:
        raise ValueError(f"--kernel {kernel!r}: expected one of {', '.join(KERNELS)}")
    if executor not in dispatch.KERNEL_EXECUTORS:
        raise ValueError(f"--executor {executor!r}: expected one of {', '.join(dispatch.KERNEL_EXECUTORS)}")
    envs = get_envs()
    if executor == "auto" and envs.DEEPINFER_KERNEL_EXECUTOR != "auto":
        executor = envs.DEEPINFER_KERNEL_EXECUTOR
    simulator = dict(envs.recorded).get("NKI_SIMULATOR", "") == "1"
    if executor in ("simulator", "neuron"):
        check_nki_version(versions()["nki"])
    try:
        return dispatch.resolve_executor(executor, simulator=simulator), simulator
    except RuntimeError as e:
        raise ValueError(str(e)) from None


def kernel_env(executor: str) -> dict[str, str]:
    """What a kernel run on the real NKI exports before its first launch: NEURON_LOGICAL_NC_CONFIG (NKI 0.7 takes
    the LNC from it, and `kernel[lnc]` must equal it, NCC_EVRF066), the user's value or TorchNeuron's first-contact
    LNC (engine/backends/torchneuron.py FIRST_CONTACT_LNC: the kernels do not split work by program id)."""
    from engine.backends.torchneuron import first_contact_lnc
    from engine.envs import get_envs

    if executor not in ("neuron", "simulator"):
        return {}
    return {"NEURON_LOGICAL_NC_CONFIG": str(first_contact_lnc(dict(get_envs().recorded)))}


def proves(executor: str) -> str:
    from nki_kernels.dispatch import PROVES

    return PROVES[executor]
