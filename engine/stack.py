"""What software stack this process runs on: one probe for results metadata and `deepinfer env`.

Versions of torch / torch-xla / torch-neuronx / neuronx-cc / nki (installed distributions, without importing
them), the PJRT device torch-xla would use, the logical NeuronCore config (LNC, read once from
NEURON_LOGICAL_NC_CONFIG; trn2's default is 2) and, where the Neuron tools are installed, `neuron-ls`. The NKI
kernels were written for NKI 0.6 (`.view()` semantics, signatures checked by nki_kernels/static_check.py):
`check_nki_version` refuses another major.minor with a clear message.
"""

from __future__ import annotations

import shutil
import subprocess
from functools import cache
from importlib import metadata
from typing import Any

from engine.envs import get_envs

STACK_PACKAGES = ("torch", "torch-xla", "torch-neuronx", "neuronx-cc", "nki", "libneuronxla", "transformers")
NKI_SUPPORTED = ("0.6",)  # major.minor the kernels were written and checked for
TRN2_DEFAULT_LNC = 2


def versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for pkg in STACK_PACKAGES:
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = None
    return out


def logical_nc_config() -> int:
    """LNC: NEURON_LOGICAL_NC_CONFIG if set, else trn2's default 2. Every kernel run and rank layout uses this."""
    raw = dict(get_envs().recorded).get("NEURON_LOGICAL_NC_CONFIG")
    if raw is None:
        return TRN2_DEFAULT_LNC
    try:
        lnc = int(raw)
    except ValueError:
        raise ValueError(f"NEURON_LOGICAL_NC_CONFIG={raw!r}: expected 1 or 2") from None
    if lnc not in (1, 2):
        raise ValueError(f"NEURON_LOGICAL_NC_CONFIG={lnc}: expected 1 or 2")
    return lnc


def check_nki_version(version: str | None) -> None:
    """Refuse an NKI release the kernels were not written for (None: NKI absent, the stand-in runs)."""
    if version is None:
        return
    mm = ".".join(version.split(".")[:2])
    if mm not in NKI_SUPPORTED:
        raise ValueError(f"nki {version} is installed; the NKI kernels here were written and checked for nki "
                         f"{' / '.join(NKI_SUPPORTED)} (.view() semantics and the signatures in "
                         f"nki_kernels/static_check.py); install nki {NKI_SUPPORTED[-1]}.x or run --kernels reference")


_CBWR_BRANCHES = {1: "OFF", 2: "AUTO", 3: "COMPATIBLE", 4: "SSE2", 6: "SSSE3", 7: "SSE4_1", 8: "SSE4_2", 9: "AVX",
                  10: "AVX2", 11: "AVX512_MIC", 12: "AVX512", 13: "AVX512_MIC_E1", 14: "AVX512_E1"}
_CBWR_STRICT = 0x10000


def blas_mode() -> dict[str, Any]:
    """The BLAS this process's torch computes fp32 GEMMs with and MKL's reproducibility (CNR) mode as MKL itself
    reports it (`mkl_cbwr_get`, exported by x86 torch wheels as mkl_serv_cbwr_get): e.g. {"blas": "mkl",
    "mkl_cbwr": "AUTO,STRICT", "threads": 2}. "OFF" means MKL chose its code path per process (engine/envs.py
    `pin_reproducible_math` came too late or was overridden). No MKL (e.g. aarch64): {"blas": ..., "mkl_cbwr": None}."""
    import ctypes
    import os

    import torch

    out: dict[str, Any] = {"blas": "mkl" if torch.backends.mkl.is_available() else "other", "mkl_cbwr": None,
                           "threads": torch.get_num_threads()}
    if out["blas"] != "mkl":
        return out
    try:
        lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
        get = lib.mkl_serv_cbwr_get
    except (OSError, AttributeError):
        return out
    get.argtypes, get.restype = [ctypes.c_int], ctypes.c_int
    mode = get(-1)  # MKL_CBWR_ALL: branch | strict flag
    name = _CBWR_BRANCHES.get(mode & 0xFFFF, str(mode & 0xFFFF))
    out["mkl_cbwr"] = name + (",STRICT" if mode & _CBWR_STRICT else "")
    return out


def _neuron_ls() -> str | None:
    exe = shutil.which("neuron-ls")
    if exe is None:
        return None
    try:
        return subprocess.run([exe], capture_output=True, text=True, timeout=20).stdout.strip() or None
    except (OSError, subprocess.SubprocessError) as e:
        return f"neuron-ls failed: {e}"


def probe() -> dict[str, Any]:
    """The stack of this process: `_installed()`, the host math mode (read now: it is set at process setup) and which
    native host-kernel build `--kernels host` runs here and why (engine/host_kernels `build_info`)."""
    from engine import host_kernels

    return {**_installed(), "host_math": blas_mode(), "host_kernels": host_kernels.build_info()}


@cache
def _installed() -> dict[str, Any]:
    """Versions, PJRT device, LNC, neuron-ls (cached: the answer does not change while the process runs)."""
    rec = dict(get_envs().recorded)
    v = versions()
    return {"versions": v, "pjrt_device": rec.get("PJRT_DEVICE"), "logical_nc_config": logical_nc_config(),
            "neuron_ls": _neuron_ls(), "nki_supported": list(NKI_SUPPORTED),
            "nki_ok": v["nki"] is None or ".".join(v["nki"].split(".")[:2]) in NKI_SUPPORTED}
