"""Neuron backend (trn2): region graphs through torch-neuronx's `torch.compile(backend="neuronx", dynamic=False)`
(dynamic shapes are unsupported, hence the static buckets). torch-neuronx / torch-xla are
imported here only, when the backend is built. Not exercised on the host; the host backend runs the same regions.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class NeuronBackend:
    name = "neuron"
    dist_backend = "xla"

    def __init__(self, config: Any = None, compiler: str = "neuronx") -> None:
        import torch_neuronx  # noqa: F401 - registers the "neuronx" torch.compile backend

        self.compiler = compiler

    @property
    def device(self) -> Any:
        import torch_xla

        return torch_xla.device()

    def setup_process(self, threads: int | None = None, rank: int = 0) -> None:
        from engine.envs import apply_env, neuron_worker_env

        apply_env(neuron_worker_env(rank))

    def compile(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        import torch

        return torch.compile(fn, backend=self.compiler, dynamic=False)

    def synchronize(self) -> None:
        import torch_xla.core.xla_model as xm

        xm.wait_device_ops()

    def boundary(self, fn: Callable[[str], None]) -> Callable[[str], None]:
        import torch

        return torch.compiler.disable(fn)
