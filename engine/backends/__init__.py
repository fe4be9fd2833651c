"""Engine backends behind a tiny protocol, with a registry and lazy imports.

A backend owns what differs between the host and a device: the torch device tensors live on, the process-group
backend of its ranks, how region graphs are captured (`compile`, once per static input shape), how queued device
work is awaited (`synchronize`, called by the region timer at every boundary), how a Python callback is kept out
of a graph (`boundary`) and how a (rank) process is set up before the engine is built (`setup_process`: threads,
reproducible math, runtime variables). `get_backend(config)` builds the one the config names; `import engine`
never imports torch-neuronx or torch-xla.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from engine.config import EngineConfig


class Backend(Protocol):
    name: str
    dist_backend: str  # torch.distributed backend of the ranks' collectives

    @property
    def device(self) -> Any: ...

    def compile_region(self, region: Any) -> Callable[..., Any]:
        """A callable `g(region, *args)` running `region(*args)` as a graph; regions of the same structure share
        it (engine/regions.py)."""
        ...

    def compile_fn(self, fn: Callable[..., Any], name: str) -> Callable[..., Any]:
        """`fn` (static shapes) as one graph per call on a graph backend; as it is on the host."""
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

    def metrics(self) -> dict[str, Any]:
        """Counters for results metadata: compiles, executions, transfers, fallbacks (empty on the host)."""
        ...

    def setup_process(self, threads: int | None = None, rank: int = 0, world: int = 1,
                      master_port: int | None = None) -> None:
        """Set this (rank) process up before any runtime starts: threads, reproducible math, runtime variables."""
        ...

    def check_parallel(self, cp: int) -> None:
        """Raise ValueError (with the reason) if this backend cannot run cp ranks here."""
        ...


_REGISTRY = {"host": "engine.backends.host:HostBackend", "xla": "engine.backends.xla:XlaBackend",
             "neuron": "engine.backends.xla:NeuronBackend"}


def get_backend(config: EngineConfig) -> Backend:
    """The backend of `config` (its `backend` is already resolved: host, xla or neuron)."""
    name = str(config.backend)
    try:
        target = _REGISTRY[name]
    except KeyError:
        raise ValueError(f"backend {name!r} is not available in this build (have: {', '.join(_REGISTRY)})") from None
    module, cls = target.split(":")
    return getattr(importlib.import_module(module), cls)(config)
