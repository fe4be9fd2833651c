"""Host backend: CPU torch; region graphs through `torch.compile(dynamic=False)`; gloo ranks.

`config.graph.host_compiler` picks the torch.compile backend: `inductor` (C++ codegen with gcc; the fastest graphs,
minutes of compile on a 2-core box for the tiny model's 8 regions x buckets), `aot_eager` (the same capture and
functionalisation, no codegen), `eager` (dynamo capture only) or `none` (no torch.compile: the region functions run
as plain Python with the same static shapes; the fast tests use it to check the static-shape path).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from engine.config import HostCompiler

if TYPE_CHECKING:
    from engine.config import EngineConfig

# Every (layer, region, batch bucket, block bucket) is one cache entry of the same few code objects.
_RECOMPILE_LIMIT = 1024


def _raise_recompile_limit() -> None:
    cfg = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(cfg, name):
            setattr(cfg, name, max(getattr(cfg, name), _RECOMPILE_LIMIT))
    for name in ("accumulated_recompile_limit", "accumulated_cache_size_limit"):
        if hasattr(cfg, name):
            setattr(cfg, name, max(getattr(cfg, name), 8 * _RECOMPILE_LIMIT))


def setup_host_process(threads: int | None = None) -> None:
    """The one place the engine sets up a host process's math, before its first matmul: MKL's reproducible mode
    (engine/envs.py `pin_reproducible_math`) and a fixed intra-op thread count (None or 0: torch's default), set
    explicitly even when it is the default, because `torch.set_num_threads` is also what turns MKL's dynamic
    thread count off (`mkl_set_dynamic(0)`): CNR holds only for a fixed number of threads."""
    from engine.envs import pin_reproducible_math

    pin_reproducible_math()
    torch.set_num_threads(int(threads) if threads else torch.get_num_threads())


class HostBackend:
    name = "host"
    dist_backend = "gloo"

    def __init__(self, config: EngineConfig | None = None, compiler: HostCompiler | str | None = None) -> None:
        chosen = compiler if compiler is not None else (config.graph.host_compiler if config is not None
                                                        else HostCompiler.INDUCTOR)
        self.compiler = HostCompiler.parse(chosen, "host compiler")
        if self.compiler is not HostCompiler.NONE:
            _raise_recompile_limit()

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def compile_region(self, region: Any) -> Callable[..., Any]:
        """`none`: the region as plain Python. Otherwise one torch.compile graph over `region` as a template, each
        layer's tensors passed in by functional_call: dynamo guards on the template (one object) and on the tensors'
        metadata, so layers of one structure reuse one graph per static shape instead of one each."""
        if self.compiler is HostCompiler.NONE:
            return lambda reg, *args: reg(*args)
        template = region.template()  # meta parameters: every call's tensors are inputs, none is the template's

        def run(params: dict[str, torch.Tensor], *args: Any) -> Any:
            return torch.func.functional_call(template, params, args)

        graph = torch.compile(run, backend=self.compiler.value, dynamic=False)
        return lambda reg, *args: graph(reg.params(), *args)

    def compile_fn(self, fn: Callable[..., Any], name: str) -> Callable[..., Any]:
        return fn  # embed / head of a decode step: one or two kernels each, nothing to gain from a graph here

    def region_end(self) -> None:
        """Eager CPU kernels: nothing to cut."""

    def step_end(self) -> None:
        """Nothing queued on the host."""

    def synchronize(self) -> None:
        """CPU kernels run synchronously; nothing to wait for."""

    def grad_context(self) -> Any:
        return torch.inference_mode()

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def metrics(self) -> dict[str, Any]:
        return {}

    def boundary(self, fn: Callable[[str], None]) -> Callable[[str], None]:
        return torch.compiler.disable(fn)  # a graph break: the stages before and after become separate graphs

    def setup_process(self, threads: int | None = None, rank: int = 0, world: int = 1,
                      master_port: int | None = None) -> None:
        setup_host_process(threads)

    def check_parallel(self, cp: int) -> None:
        """gloo ranks on this host: any layout the config accepted."""
