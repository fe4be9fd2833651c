"""Host backend: CPU torch; region graphs through `torch.compile(dynamic=False)`; gloo ranks.

`config.graph.host_compiler` picks the torch.compile backend: `inductor` (C++ codegen with gcc; the fastest graphs,
minutes of compile on a 2-core box for the tiny model's 8 regions x buckets), `aot_eager` (the same capture and
functionalisation, no codegen), `eager` (dynamo capture only) or `none` (no torch.compile: the region functions run
as plain Python with the same static shapes; the fast tests use it to check the static-shape path).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from engine.backends import Counters, counted_compiler
from engine.choices import HostCompiler
from engine.model.capabilities import HOST

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.parallel import Parallel

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
    kernel_tables = ("reference", "stand-in", "host")
    capabilities = HOST

    def __init__(self, config: EngineConfig | None = None, compiler: HostCompiler | str | None = None) -> None:
        chosen = compiler if compiler is not None else (config.graph.host_compiler if config is not None
                                                        else HostCompiler.INDUCTOR)
        self.compiler = HostCompiler.parse(chosen, "host compiler")
        self._counters = Counters(device="cpu")
        if self.compiler is not HostCompiler.NONE:
            _raise_recompile_limit()

    @classmethod
    def kernel_hint(cls, kernels: str) -> str:
        return ": --kernels nki runs the NKI kernels on a Neuron device (--backend neuron); on the host, --kernels " \
               "stand-in executes them on the NumPy stand-in" if kernels == "nki" else ""

    @classmethod
    def measured_on(cls) -> str:
        return "host CPU (torch)"

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    def _compiler(self) -> Callable[..., Any]:
        """The torch.compile backend of `self.compiler`, counting each graph it compiles and the seconds it takes."""
        return counted_compiler(torch._dynamo.lookup_backend(self.compiler.value), self._counters)

    def compile_region(self, region: Any) -> Callable[..., Any]:
        """`none`: the region as plain Python. Otherwise one torch.compile graph over `region` as a template, each
        layer's tensors passed in by functional_call: dynamo guards on the template (one object) and on the tensors'
        metadata, so layers of one structure reuse one graph per static shape instead of one each."""
        c = self._counters
        if self.compiler is HostCompiler.NONE:
            def plain(reg: Any, *args: Any) -> Any:
                c.executions += 1
                return reg(*args)

            return plain
        template = region.template()  # meta parameters: every call's tensors are inputs, none is the template's

        def run(params: dict[str, torch.Tensor], *args: Any) -> Any:
            return torch.func.functional_call(template, params, args)

        graph = torch.compile(run, backend=self._compiler(), dynamic=False)

        def call(reg: Any, *args: Any) -> Any:
            c.executions += 1
            return graph(reg.params(), *args)

        return call

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

    def counters(self) -> Counters:
        return dataclasses.replace(self._counters, fallback_ops=dict(self._counters.fallback_ops))

    def boundary(self, fn: Callable[[str], None]) -> Callable[[str], None]:
        return torch.compiler.disable(fn)  # a graph break: the stages before and after become separate graphs

    def setup_process(self, threads: int | None = None, rank: int = 0, world: int = 1,
                      master_port: int | None = None) -> None:
        setup_host_process(threads)

    @classmethod
    def check_parallel(cls, cp: int) -> None:
        """gloo ranks on this host: any layout the config accepted."""

    def join_group(self, rank: int, world: int, master_port: int | None, timeout_s: float) -> Parallel:
        from engine.parallel import join_group

        if master_port is None:  # torchrun's rendezvous
            return join_group("gloo", "env://", world, timeout_s, backend=self)
        return join_group("gloo", f"tcp://127.0.0.1:{master_port}", world, timeout_s, rank=rank, backend=self)

    def export_graphs(self, runner: Any, out_dir: Path, graphs: Sequence[str] = ()) -> list[dict[str, Any]]:
        raise ValueError("deepinfer compile writes device graphs for an offline compiler: use --backend xla "
                         "(HLO for neuronx-cc) or neuron; the host backend compiles its graphs itself")
