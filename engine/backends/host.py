"""Host backend: region graphs through `torch.compile(dynamic=False)` on CPU torch.

`compiler` picks the torch.compile backend: `inductor` (C++ codegen with gcc; the fastest graphs, minutes of
compile on a 2-core box for the tiny model's 8 regions x buckets), `aot_eager` (the same capture and
functionalisation, no codegen), `eager` (dynamo capture only) or `none` (no torch.compile: the region functions run
as plain Python with the same static shapes; the fast tests use it to check the static-shape path).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

COMPILERS = ("inductor", "aot_eager", "eager", "none")
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


class HostBackend:
    name = "host"

    def __init__(self, compiler: str = "inductor") -> None:
        if compiler not in COMPILERS:
            raise ValueError(f"host compiler {compiler!r}: expected one of {', '.join(COMPILERS)}")
        self.compiler = compiler
        if compiler != "none":
            _raise_recompile_limit()

    def compile(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        if self.compiler == "none":
            return fn
        return torch.compile(fn, backend=self.compiler, dynamic=False)

    def synchronize(self) -> None:
        """CPU kernels run synchronously; nothing to wait for."""

    def boundary(self, fn: Callable[[str], None]) -> Callable[[str], None]:
        return torch.compiler.disable(fn)  # a graph break: the stages before and after become separate graphs
