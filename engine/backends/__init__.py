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

    def compile(self, fn: Callable[..., Any]) -> Callable[..., Any]: ...

    def synchronize(self) -> None: ...

    def boundary(self, fn: Callable[[str], None]) -> Callable[[str], None]: ...

    def setup_process(self, threads: int | None = None, rank: int = 0) -> None: ...


_REGISTRY = {"host": "engine.backends.host:HostBackend", "neuron": "engine.backends.neuron:NeuronBackend"}


def get_backend(config: EngineConfig) -> Backend:
    """The backend of `config` (its `backend` is already resolved: host, xla or neuron)."""
    name = str(config.backend)
    try:
        target = _REGISTRY[name]
    except KeyError:
        raise ValueError(f"backend {name!r} is not available in this build (have: {', '.join(_REGISTRY)})") from None
    module, cls = target.split(":")
    return getattr(importlib.import_module(module), cls)(config)
