"""What software stack this process runs on: one probe for results metadata and `deepinfer env`.

Versions of torch / torch-xla / torch-neuronx / neuronx-cc / nki (installed distributions, without importing
them), the PJRT device torch-xla would use, the logical NeuronCore config (LNC, read once from
NEURON_LOGICAL_NC_CONFIG; trn2's default is 2) and, where the Neuron tools are installed, `neuron-ls`.

**Which Neuron stack** (`neuron_stack()`): torch-neuronx comes in two kinds that share a name. TorchNeuron (the native
PyTorch backend, torch-neuronx >= 2.13 with torch 2.13 / 2.14, Neuron SDK 2.33+: a `neuron` device, `nki_op` and
`wrap_nki`) is what `--backend neuron` runs on; torch-neuronx <= 2.9 is the PyTorch/XLA stack (torch-xla on the
Neuron PJRT device, unsupported for inference on trn2 from SDK 2.34), which the engine runs as `--backend xla` with
PJRT_DEVICE=NEURON. The PyPI "torch-neuronx" (1.0) is a placeholder. The kind is read from the installed
distribution's version; only when no distribution metadata exists (a source tree) is the module imported to look
for `nki_op` / `wrap_nki`.

The NKI kernels were written for NKI 0.6 (`.view()` semantics, signatures checked by nki_kernels/static_check.py) and
read against the NKI 0.7 / 0.8 notes of TorchNeuron's SDKs 2.33 / 2.34 (nki_kernels/_nki.py: no source change needed
by those notes; not compiled with either here): `check_nki_version` accepts 0.6, 0.7 and 0.8 and refuses another
major.minor with a clear message.
"""

from __future__ import annotations

import glob
import importlib
import importlib.util
import shutil
import subprocess
import sys
from dataclasses import dataclass
from functools import cache
from importlib import metadata
from typing import Any

from engine.envs import get_envs

STACK_PACKAGES = ("torch", "torch-xla", "torch-neuronx", "neuronx-cc", "nki", "libneuronxla", "transformers")
NKI_SUPPORTED = ("0.6", "0.7", "0.8")  # major.minor the kernels were written for / read against (_nki.py notes)
TRN2_DEFAULT_LNC = 2
TORCHNEURON_MIN = (2, 13)  # torch-neuronx 2.13.x / 2.14.x: the native backend (TorchNeuron); <= 2.9: PyTorch/XLA


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
                         f"{' / '.join(NKI_SUPPORTED)} (.view() semantics, the signatures in "
                         "nki_kernels/static_check.py and the 0.7 / 0.8 notes in nki_kernels/_nki.py); install nki "
                         f"{NKI_SUPPORTED[-1]}.x (Neuron SDK 2.34) or run --kernels reference")


@dataclass(frozen=True)
class NeuronStack:
    """Which Neuron stack this Python environment has (`neuron_stack()`).

    kind: "torchneuron" (native torch-neuronx >= 2.13: `--backend neuron`), "xla" (torch-neuronx on PyTorch/XLA,
    <= 2.9: `--backend xla` with PJRT_DEVICE=NEURON), "placeholder" (the PyPI stub) or "absent"."""

    kind: str
    version: str | None  # torch-neuronx's version (distribution metadata, else the module's __version__)
    device: bool  # a Neuron device node exists (/dev/neuron*)
    why: str = ""  # how the kind was told

    @property
    def native(self) -> bool:
        return self.kind == "torchneuron"

    def describe(self) -> str:
        v = f"torch-neuronx {self.version}" if self.version else "torch-neuronx"
        what = {"torchneuron": f"{v} (TorchNeuron, the native backend)",
                "xla": f"{v} (the PyTorch/XLA stack)", "placeholder": f"{v} (the PyPI placeholder, not the SDK)",
                "absent": "no torch-neuronx"}[self.kind]
        return f"{what}; Neuron device: {'yes' if self.device else 'none visible (no /dev/neuron*)'}"

    def as_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "torch_neuronx": self.version, "device": self.device, "why": self.why}


def _version_tuple(version: str) -> tuple[int, ...]:
    out = []
    for part in version.split(".")[:2]:
        digits = "".join(ch for ch in part if ch.isdigit())
        out.append(int(digits) if digits else 0)
    return tuple(out)


def _module_kind() -> tuple[str, str | None, str] | None:
    """torch_neuronx without distribution metadata (a source tree, a test's fake): importable? native API?"""
    mod = sys.modules.get("torch_neuronx")
    if mod is None:
        try:
            if importlib.util.find_spec("torch_neuronx") is None:
                return None
        except (ImportError, ValueError):
            return None
        try:
            mod = importlib.import_module("torch_neuronx")
        except Exception as e:  # noqa: BLE001 - the placeholder raises ImportError; anything else: not usable
            return "placeholder", None, f"import torch_neuronx failed: {type(e).__name__}: {e}"
    version = getattr(mod, "__version__", None)
    if hasattr(mod, "nki_op") and hasattr(mod, "wrap_nki"):
        return "torchneuron", version, "module has nki_op and wrap_nki"
    return "xla", version, "module has no nki_op / wrap_nki"


def has_neuron_device() -> bool:
    """A Neuron device node exists (the probe vllm-neuron uses)."""
    return bool(glob.glob("/dev/neuron*"))


def neuron_stack() -> NeuronStack:
    """The Neuron stack of this environment, without importing torch-neuronx when its distribution is installed
    (the version tells the kind: >= 2.13 TorchNeuron, < 2 the PyPI placeholder, else PyTorch/XLA)."""
    device = has_neuron_device()
    try:
        version: str | None = metadata.version("torch-neuronx")
    except metadata.PackageNotFoundError:
        version = None
    if version is not None:
        vt = _version_tuple(version)
        if vt < (2,):
            return NeuronStack("placeholder", version, device, "distribution version < 2 (PyPI placeholder)")
        kind = "torchneuron" if vt >= TORCHNEURON_MIN else "xla"
        return NeuronStack(kind, version, device, f"distribution version {version}")
    found = _module_kind()
    if found is None:
        return NeuronStack("absent", None, device, "torch_neuronx not importable")
    kind, version, why = found
    return NeuronStack(kind, version, device, why)


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
    return {"versions": v, "neuron_stack": neuron_stack().as_dict(), "pjrt_device": rec.get("PJRT_DEVICE"),
            "logical_nc_config": logical_nc_config(), "neuron_ls": _neuron_ls(), "nki_supported": list(NKI_SUPPORTED),
            "nki_ok": v["nki"] is None or ".".join(v["nki"].split(".")[:2]) in NKI_SUPPORTED}
