"""`deepinfer env`: the resolved DEEPINFER_* flags, the recorded runtime variables and the software stack, as
tables (no printing)."""

from __future__ import annotations

import pandas as pd


def env_tables() -> tuple[list[tuple[str, pd.DataFrame]], dict[str, str | None]]:
    """([(title, table), ...], extras): the flags (value, default, type, doc), the recorded NEURON_*/NKI_*/...
    variables, the stack (torch / XLA / Neuron versions, PJRT device, LNC, host math); extras: `neuron_ls` (its
    output where installed) and `graph_hash`."""
    from engine.envs import Envs, get_envs
    from engine.stack import probe

    envs = get_envs()
    tables = [("DEEPINFER_* flags", pd.DataFrame([
        {"flag": name, "value": repr(getattr(envs, name)), "default": default, "type": typ, "doc": doc}
        for name, typ, default, doc in Envs.describe()]))]
    if envs.recorded:
        tables.append(("Recorded runtime variables",
                       pd.DataFrame([{"variable": k, "value": v} for k, v in envs.recorded])))
    auto = _kernels_auto(envs.DEEPINFER_BACKEND)  # first: loading may step down a build, which the probe reports
    st = probe()
    rows = [{"item": k, "value": str(v)} for k, v in st["versions"].items()]
    rows += [{"item": k, "value": str(st[k])} for k in ("pjrt_device", "logical_nc_config", "nki_supported", "nki_ok")]
    rows += [{"item": f"host_math.{k}", "value": str(v)} for k, v in st["host_math"].items()]
    rows.append({"item": "kernels auto", "value": auto})
    tables.append(("Stack (torch / XLA / Neuron)", pd.DataFrame(rows)))
    kernels = st.get("host_kernels") or {}
    if kernels.get("variants"):
        loaded = kernels.get("loaded") or {}
        fp8 = {loaded.get("variant"): f"; FP8 decoder {loaded['fp8_decoder']}"} if "fp8_decoder" in loaded else {}
        tables.append((f"--kernels host builds on this CPU (chosen: {kernels.get('chosen')})", pd.DataFrame(
            [{"build": name, "status": f"{status}{fp8.get(name, '')}"}
             for name, status in kernels["variants"].items()])))
    return tables, {"neuron_ls": st["neuron_ls"], "graph_hash": envs.graph_hash()}


def _kernels_auto(backend: str) -> str:
    """What `--kernels auto` (the default) resolves to on DEEPINFER_BACKEND here, and why; builds the host kernels
    where it resolves to them (loading may step down a build, which the probe then reports)."""
    from engine import host_kernels
    from engine.config import resolve_backend, resolve_kernels

    try:
        kernels, why = resolve_kernels("auto", resolve_backend(backend))
    except ValueError as e:  # a bad DEEPINFER_BACKEND: say so here, the flags table shows the value
        return f"unresolved: {e}"
    if str(kernels) == "host":  # the config resolves without building: build / load here, as an engine would
        try:
            host_kernels.ensure_loaded()
        except host_kernels.HostKernelError as e:
            return f"{kernels} ({why}), but its build fails here: {e}"
    return f"{kernels} ({why})"
