"""Engine backends behind one protocol, with a registry and lazy imports.

A backend owns everything that differs between the host and a device, so that nothing outside `engine/backends/`
tests a device type or imports a device stack:

* where tensors live (`device`) and the autograd mode (`grad_context`); the step's one copy back (`to_host`);
* how graphs are made: region graphs (`compile_region`, one per region structure and static shape), single
  functions (`compile_fn`), the cuts between them (`region_end`, `step_end`), waiting for queued work
  (`synchronize`), keeping a Python callback out of a graph (`boundary`);
* what the model may do on it (`capabilities`: e.g. whether data-dependent shapes are cheap) and which op tables
  (`--kernels`) it runs (`kernel_tables`);
* its processes: setting one up before any runtime starts (`setup_process`: threads, reproducible math, runtime
  variables), which layouts it can run (`check_parallel`), joining the job's process group (`join_group`);
* its counters, in one schema every backend fills (`counters() -> Counters`);
* writing its graphs for an offline compiler (`export_graphs`, `deepinfer compile`);
* what its numbers are (`measured_on`: e.g. "xla (the PyTorch/XLA lane) on PJRT CPU (not trn2 numbers)").

Registry: `host` (CPU torch), `xla` (the PyTorch/XLA lane: PJRT CPU here, the legacy torch-neuronx 2.9 stack on the
Neuron PJRT device elsewhere), `neuron` (TorchNeuron, the SDK's native backend) and `neuron-standin` (the TorchNeuron
backend with its compile step on a CPU stand-in: engine/backends/torchneuron.py).

`get_backend(config)` builds the one the config names (once per process: engine/launch.py passes it on) and checks
that the config's kernel table runs on it; `backend_class(name)` gives the class without building it (what the
parent process of a multi-rank job needs). `import engine` never imports torch-neuronx or torch-xla.
"""

from __future__ import annotations

import dataclasses
import importlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from engine.model.capabilities import Capabilities

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.parallel import Parallel

__all__ = ["Backend", "Capabilities", "Counters", "backend_class", "check_available", "get_backend", "measured_on"]


@dataclass
class Counters:
    """What a backend did so far in this process, the same fields on every backend (0 where a backend has no such
    event; the host has no transfers and no fallbacks)."""

    device: str = "cpu"
    compiles: int = 0  # every graph compiled (on xla also eager mode's one-op graphs)
    graph_compiles: int = 0  # the engine's own graphs (regions, embed, head, prefill chunks)
    executions: int = 0  # graph executions
    transfers_to_host: int = 0
    transfers_to_device: int = 0
    fallbacks: int = 0  # ops or graphs that ran elsewhere than asked (CPU fallbacks, graphs left eager)
    compile_seconds: float = 0.0
    fallback_ops: dict[str, int] = field(default_factory=dict)
    graph_pieces: int = 0  # pure pieces of graphs cut at kernel custom ops (the CPU stand-in: standin_split.py)
    custom_op_calls: dict[str, int] = field(default_factory=dict)  # kernel custom ops run inside graphs, per op

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def minus(self, earlier: Counters) -> dict[str, float]:
        """The numeric counters since `earlier` (a snapshot of the same backend)."""
        return {f.name: getattr(self, f.name) - getattr(earlier, f.name) for f in dataclasses.fields(self)
                if f.name not in ("device", "fallback_ops", "custom_op_calls")}


class Backend(Protocol):
    name: str
    kernel_tables: tuple[str, ...]  # the --kernels values this backend runs
    capabilities: Capabilities

    @property
    def device(self) -> Any: ...

    def compile_region(self, region: Any) -> Callable[..., Any]:
        """A callable `g(region, *args)` running `region(*args)` as a graph; regions of the same structure share
        it (engine/regions.py)."""
        ...

    def compile_fn(self, fn: Callable[..., Any], name: str) -> Callable[..., Any]:
        """`fn` (static shapes) as one graph per call shape on a graph backend; as it is on the host."""
        ...

    def region_end(self) -> None:
        """After each region of a decode step (a lazy-tensor backend cuts its graph here)."""
        ...

    def step_end(self) -> None:
        """After each engine step, before its logits are read."""
        ...

    def synchronize(self) -> None:
        """Wait for all queued device work (region timing calls it at every boundary)."""
        ...

    def boundary(self, fn: Callable[[str], None]) -> Callable[[str], None]:
        """`fn` kept out of a captured graph (region timing's split points)."""
        ...

    def grad_context(self) -> Any:
        """The autograd mode the engine runs under (inference_mode on the host; no_grad on torch-xla)."""
        ...

    def to_host(self, t: Any) -> Any:
        """A step's result (logits) as a CPU tensor: the one device-to-host copy of a step."""
        ...

    def counters(self) -> Counters:
        """A snapshot of this backend's counters."""
        ...

    def setup_process(self, threads: int | None = None, rank: int = 0, world: int = 1,
                      master_port: int | None = None) -> None:
        """Set this (rank) process up before any runtime starts: threads, reproducible math, runtime variables."""
        ...

    @classmethod
    def check_parallel(cls, cp: int) -> None:
        """Raise ValueError (with the reason) if this backend cannot run cp ranks here."""
        ...

    def join_group(self, rank: int, world: int, master_port: int | None, timeout_s: float) -> Parallel:
        """Join the job's process group as `rank` of `world` (master_port None: torchrun's env:// rendezvous);
        the returned Parallel also has the gloo control group rank 0's step messages travel on."""
        ...

    def export_graphs(self, runner: Any, out_dir: Path, graphs: Sequence[str] = ()) -> list[dict[str, Any]]:
        """Write every graph a step of `runner` can run, for the backend's offline compiler, or those `graphs`
        selects (glob patterns of graph names; one that names no graph is a ValueError); manifest rows."""
        ...

    @classmethod
    def measured_on(cls) -> str:
        """What this backend's timings are, for table titles, plots and meta.json."""
        ...


_REGISTRY = {"host": "engine.backends.host:HostBackend", "xla": "engine.backends.xla:XlaBackend",
             "neuron": "engine.backends.torchneuron:TorchNeuronBackend",
             "neuron-standin": "engine.backends.torchneuron:NeuronStandinBackend"}


def backend_class(name: Any) -> type:
    """The backend class registered under `name` (host, xla, neuron, neuron-standin), imported now (not built)."""
    key = str(name)
    try:
        target = _REGISTRY[key]
    except KeyError:
        raise ValueError(f"backend {key!r} is not available in this build (have: {', '.join(_REGISTRY)})") from None
    module, cls = target.split(":")
    return getattr(importlib.import_module(module), cls)


def get_backend(config: EngineConfig) -> Backend:
    """The backend of `config` (its `backend` is already resolved), after checking that it runs the config's op
    table (`--kernels`): one clear line otherwise, before anything is loaded."""
    cls = backend_class(config.backend)
    kernels = str(config.kernels)
    if kernels not in cls.kernel_tables:
        raise ValueError(f"--kernels {kernels} does not run on --backend {config.backend} (it runs "
                         f"{', '.join(cls.kernel_tables)}){cls.kernel_hint(kernels)}")
    return cls(config)


def check_available(name: Any, compile_only: bool = False) -> None:
    """Raise one line (ValueError) when backend `name`'s stack is missing here (`available` of its class, if it has
    one: the device backends), before anything is built or printed. `compile_only`: a compile-only run needs no
    device."""
    cls = backend_class(name)
    check = getattr(cls, "available", None)
    if check is not None:
        check(compile_only=compile_only)


def measured_on(name: Any) -> str:
    """`Backend.measured_on()` of the backend registered under `name`."""
    return backend_class(name).measured_on()


def counted_compiler(inner: Callable[..., Any], counters: Counters) -> Callable[..., Any]:
    """Dynamo backend `inner` counting each graph it compiles and the seconds its compile call takes."""

    def counted(gm: Any, example_inputs: list[Any]) -> Any:
        t0 = time.perf_counter()
        out = inner(gm, example_inputs)
        counters.compiles += 1
        counters.graph_compiles += 1
        counters.compile_seconds += time.perf_counter() - t0
        return out

    return counted

