"""The only module that reads the process environment.

Every `DEEPINFER_*` flag is declared once here with its type, default and a one-line doc. `read_envs(environ)` is a
pure function (tests pass a dict); `get_envs()` caches the result for the real process. Third-party variables that
the Neuron runtime reads (`NEURON_*`) are set or recorded here too, never scattered through the code.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

from engine.choices import Backend, GraphMode, HostCompiler
from nki_kernels.dispatch import KERNEL_EXECUTORS


def _flag(default: Any, doc: str, *, graph: bool = False, choices: tuple[str, ...] | None = None) -> Any:
    return field(default=default, metadata={"doc": doc, "graph": graph, "choices": choices})


@dataclass(frozen=True)
class Envs:
    DEEPINFER_NEURON_GRAPH_MODE: str = _flag(
        "auto", "How the decode step is cut into compiled graphs: eager (none), regions (two per layer), layer (one); "
        "auto: eager on the host backend, layer on xla / neuron",
        graph=True, choices=GraphMode.values())
    DEEPINFER_NEURON_REGION_TIMING: bool = _flag(
        False, "Run each region stage by stage with a device sync and a timer at every split() boundary")
    DEEPINFER_NEURON_MOE_CAPACITY: float = _flag(
        0.0, "Capacity factor of the grouped expert path for prefill chunks (0 = dense path only)", graph=True)
    DEEPINFER_HOST_COMPILER: str = _flag(
        "inductor", "torch.compile backend for region graphs on the host: inductor, aot_eager, eager (dynamo "
        "capture only) or none (no compile; same static-shape code)", graph=True, choices=HostCompiler.values())
    DEEPINFER_BACKEND: str = _flag("auto", "Engine backend: auto (neuron where a Neuron device and TorchNeuron are, "
                                   "else host), host (CPU torch), xla (the PyTorch/XLA lane), neuron (TorchNeuron) "
                                   "or neuron-standin (TorchNeuron's compile pipeline on a CPU stand-in)", graph=True,
                                   choices=Backend.values())
    DEEPINFER_KERNEL_EXECUTOR: str = _flag(
        "auto", "Where `deepinfer kernels` runs the NKI kernels: auto, stand-in, simulator or neuron", graph=True,
        choices=KERNEL_EXECUTORS)
    DEEPINFER_NUM_THREADS: int = _flag(0, "torch intra-op threads on the host (0 = torch's default)")
    DEEPINFER_DIST_TIMEOUT_S: float = _flag(120.0, "Seconds a rank waits on a collective before the job fails")
    DEEPINFER_HOST_CC: str = _flag("gcc", "C compiler that builds the native kernels of --kernels host (gcc; clang "
                                          "builds them too, single-threaded: it has no OpenMP code for torch's "
                                          "libgomp)")
    DEEPINFER_HOST_SIMD: str = _flag(
        "auto", "Most capable --kernels host build to load: auto (the best this CPU runs), avx512-vbmi, avx512, avx2 "
        "or portable; a lower one emulates an older CPU", graph=True,
        choices=("auto", "avx512-vbmi", "avx512", "avx2", "portable"))
    DEEPINFER_HOST_HUGE_PAGES: str = _flag(
        "auto", "Host weights in one arena on transparent huge pages (auto: where the kernel's THP mode is madvise or "
        "always; off: torch's own allocations, 4 KiB pages under madvise)", choices=("auto", "off"))
    DEEPINFER_HOST_KERNEL_CACHE: str = _flag(
        "", "Directory of the compiled --kernels host libraries (empty: $XDG_CACHE_HOME/deepinfer/host_kernels, "
        "else ~/.cache/deepinfer/host_kernels)")
    DEEPINFER_REFERENCE_CACHE: str = _flag(
        "", "Directory of the HF reference cache of `deepinfer golden` / `deepinfer reference` (empty: "
        "$XDG_CACHE_HOME/deepinfer/reference, else ~/.cache/deepinfer/reference)")
    DEEPINFER_TRACEBACK: bool = _flag(False, "Show full Python tracebacks for user-facing errors (bad config, "
                                             "checkpoint, layout...) instead of one clear line")
    # Recorded, not interpreted: third-party variables that change what a Neuron run does.
    recorded: tuple[tuple[str, str], ...] = ()

    def graph_hash(self) -> str:
        """Hash of the flags that change compiled graphs or kernel choice (compile-cache key, results meta)."""
        sel = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.metadata.get("graph")}
        return hashlib.sha256(json.dumps(sel, sort_keys=True).encode()).hexdigest()[:12]

    def snapshot(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "recorded"}
        d["recorded"] = dict(self.recorded)
        d["graph_hash"] = self.graph_hash()
        return d

    @staticmethod
    def describe() -> list[tuple[str, str, str, str]]:
        """(name, type, default, doc) for every flag."""
        return [(f.name, f.type if isinstance(f.type, str) else f.type.__name__, repr(f.default), f.metadata["doc"])
                for f in dataclasses.fields(Envs) if f.name != "recorded"]


_RECORDED_PREFIXES = ("NEURON_", "NKI_", "TORCH_NEURONX_", "XLA_", "PJRT_", "TPU_", "CPU_NUM_DEVICES", "MASTER_ADDR",
                      "MASTER_PORT",
                      "WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MKL_", "OMP_NUM_THREADS")


def _parse(name: str, typ: str, raw: str, choices: tuple[str, ...] | None) -> Any:
    raw = raw.strip()
    if typ == "bool":
        if raw.lower() in ("1", "true", "yes", "on"):
            return True
        if raw.lower() in ("", "0", "false", "no", "off"):
            return False
        raise ValueError(f"{name}={raw!r}: expected 0/1/true/false")
    if typ == "int":
        try:
            return int(raw)
        except ValueError:
            raise ValueError(f"{name}={raw!r}: expected an integer") from None
    if typ == "float":
        try:
            return float(raw)
        except ValueError:
            raise ValueError(f"{name}={raw!r}: expected a number") from None
    if choices and raw not in choices:
        raise ValueError(f"{name}={raw!r}: expected one of {', '.join(choices)}")
    return raw


def read_envs(environ: Mapping[str, str]) -> Envs:
    """Parse the DEEPINFER_* flags from `environ` (pure). Unknown DEEPINFER_* names are an error (typo guard)."""
    values: dict[str, Any] = {}
    known = {f.name: f for f in dataclasses.fields(Envs) if f.name != "recorded"}
    for key, raw in environ.items():
        if not key.startswith("DEEPINFER_"):
            continue
        if key not in known:
            raise ValueError(f"unknown environment flag {key} (known: {', '.join(sorted(known))})")
        f = known[key]
        typ = f.type if isinstance(f.type, str) else f.type.__name__
        values[key] = _parse(key, typ, raw, f.metadata.get("choices"))
    recorded = tuple(sorted((k, v) for k, v in environ.items() if k.startswith(_RECORDED_PREFIXES)))
    return Envs(**values, recorded=recorded)


def engine_defaults(envs: Envs) -> dict[str, Any]:
    """The engine settings these flags supply when a command does not set them (EngineConfig's flat names), plus
    `world_size` under torchrun (WORLD_SIZE > 1: the job's ranks are torchrun's, so cp is that). Flags only fill
    defaults: nothing below the config reads them."""
    out: dict[str, Any] = {"graph_mode": envs.DEEPINFER_NEURON_GRAPH_MODE,
                           "region_timing": envs.DEEPINFER_NEURON_REGION_TIMING,
                           "moe_capacity": envs.DEEPINFER_NEURON_MOE_CAPACITY,
                           "host_compiler": envs.DEEPINFER_HOST_COMPILER, "backend": envs.DEEPINFER_BACKEND}
    world = torchrun_world_size(envs)
    if world > 1:
        out["world_size"] = world
    return out


def torchrun_world_size(envs: Envs | None = None) -> int:
    """WORLD_SIZE as torchrun set it for this process (1 when not launched by torchrun)."""
    raw = dict((envs or get_envs()).recorded).get("WORLD_SIZE", "1")
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"WORLD_SIZE={raw!r}: expected an integer") from None


@cache
def get_envs() -> Envs:
    return read_envs(os.environ)


def host_kernel_cache_dir(envs: Envs | None = None) -> Path:
    """Where `--kernels host` keeps its compiled libraries: DEEPINFER_HOST_KERNEL_CACHE, else the XDG cache."""
    envs = envs or get_envs()
    if envs.DEEPINFER_HOST_KERNEL_CACHE:
        return Path(envs.DEEPINFER_HOST_KERNEL_CACHE).expanduser()
    return cache_root() / "host_kernels"


def cache_root() -> Path:
    """This user's deepinfer cache directory: $XDG_CACHE_HOME/deepinfer, else ~/.cache/deepinfer."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "deepinfer"


def environ() -> MutableMapping[str, str]:
    """The process environment, for the few places that must hand it to a child process or the Neuron runtime."""
    return os.environ


def neuron_worker_env(rank: int, *, world_size: int = 1, logical_nc_config: int = 2, cores_per_rank: int = 1,
                      master_addr: str = "127.0.0.1", master_port: int | None = None) -> dict[str, str]:
    """Runtime variables for Neuron worker rank `rank` of `world_size` on this host, set before its runtime starts:
    its NeuronCores (`cores_per_rank` logical cores at LNC `logical_nc_config`), the Neuron PJRT process layout, and
    the variables torchrun would set, so torch-xla's Neuron plugin and its `xla://` rendezvous configure the rank
    exactly as under `torchrun --nproc-per-node world_size`."""
    first = rank * cores_per_rank
    cores = str(first) if cores_per_rank == 1 else f"{first}-{first + cores_per_rank - 1}"
    env = {
        "PJRT_DEVICE": "NEURON",
        "NEURON_RT_VISIBLE_CORES": cores,
        "NEURON_RT_NUM_CORES": str(cores_per_rank),
        "NEURON_LOGICAL_NC_CONFIG": str(logical_nc_config),
        "NEURON_PLATFORM_TARGET_OVERRIDE": "trn2",
        "NEURON_PJRT_PROCESS_INDEX": str(rank),
        "NEURON_PJRT_WORLD_SIZE": str(world_size),
        "PJRT_LOCAL_PROCESS_RANK": str(rank),
        "PJRT_LOCAL_PROCESS_COUNT": str(world_size),
    }
    if world_size > 1 and master_port is not None:  # our launcher (under torchrun, torchrun's variables stand)
        env.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
                    "LOCAL_WORLD_SIZE": str(world_size), "GROUP_RANK": "0", "MASTER_ADDR": master_addr,
                    "MASTER_PORT": str(master_port), "TORCHELASTIC_RUN_ID": "deepinfer",
                    "NEURON_RT_ROOT_COMM_ID": f"{master_addr}:62182"})
    return env


# Reproducible host math. x86 torch wheels do their fp32 GEMMs in MKL, which by default picks its code path, cache
# blocking and thread scheduling per process (MKL's "conditional numerical reproducibility" (CNR) mode off): the
# same model on the same inputs can round differently from one process to the next, and the golden verdict once
# depended on that draw (1 process in 15). MKL reads these variables once, at its first call, so they are set
# before any matmul: by the CLI entry point and by the engine's process setup (engine/backends/host.py), and rank
# processes inherit them. AUTO: the best branch for this CPU with fixed cache sizes, deterministic reductions and
# static scheduling; STRICT: ?gemm bitwise the same whatever the thread count (AVX2 / AVX-512 branches). A value
# the user set is kept (e.g. MKL_CBWR=COMPATIBLE for the same results on every x86 CPU).
REPRODUCIBLE_MATH_ENV = {"MKL_CBWR": "AUTO,STRICT", "MKL_DYNAMIC": "FALSE"}


def pin_reproducible_math() -> dict[str, str]:
    """Set `REPRODUCIBLE_MATH_ENV` in this process where the user has not; returns what was set. Effective only
    before MKL's first call in the process (engine.stack.blas_mode() says whether it took)."""
    added = {k: v for k, v in REPRODUCIBLE_MATH_ENV.items() if k not in os.environ}
    if added:
        os.environ.update(added)
        get_envs.cache_clear()
    return added


def apply_env(updates: Mapping[str, str]) -> None:
    """Set variables for the Neuron runtime of this process (called before the runtime starts)."""
    os.environ.update(updates)
    get_envs.cache_clear()
