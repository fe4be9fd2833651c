"""Region-graph backends behind a tiny protocol, with a registry and lazy imports (house style §11.1).

A backend compiles a region function once per static input shape and reuses it (`compile`), waits for queued
device work (`synchronize`, called by the region timer at every boundary) and keeps a Python callback out of a
graph (`boundary`: with region timing on, each `split()` becomes such a callback, so a region runs stage by stage).
`import engine` never imports torch-neuronx: `neuron` is imported only when asked for.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any, Protocol


class Backend(Protocol):
    name: str

    def compile(self, fn: Callable[..., Any]) -> Callable[..., Any]: ...

    def synchronize(self) -> None: ...

    def boundary(self, fn: Callable[[str], None]) -> Callable[[str], None]: ...


_REGISTRY = {"host": "engine.backends.host:HostBackend", "neuron": "engine.backends.neuron:NeuronBackend"}


def get_backend(name: str, **options: Any) -> Backend:
    """`host` (torch.compile on CPU; option `compiler`) or `neuron` (torch-neuronx)."""
    try:
        target = _REGISTRY[name]
    except KeyError:
        raise ValueError(f"backend {name!r}: expected one of {', '.join(_REGISTRY)}") from None
    module, cls = target.split(":")
    return getattr(importlib.import_module(module), cls)(**options)
