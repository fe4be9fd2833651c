"""Per-region timing: `RegionTimer.region(name, layer)` around a region, `split(stage)` at each
stage boundary inside it. Every boundary calls the backend's `synchronize()` before reading the clock, since device
work is asynchronous. Disabled, `region()` returns one shared nullcontext and region code gets `no_split`, which a
compiled graph traces away: no extra cost in the hot path.

Rows aggregate per (region, stage, layer): calls, total_ms, p50_ms, p90_ms. `engine` returns plain rows; the bench
turns them into DataFrames (engine never imports pandas).
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

TIMING_COLUMNS = ["region", "stage", "layer", "calls", "total_ms", "p50_ms", "p90_ms"]
REST = "(rest)"  # time in a region after its last split() (the whole region when it has none)


def no_split(stage: str) -> None:
    """Stage boundary when timing is off: does nothing (and leaves no trace in a compiled graph)."""


def quantiles(values: Sequence[float], *qs: float) -> tuple[float, ...]:
    """Linear-interpolated percentiles (numpy's default method) of `values`, one per q in [0, 100]; NaN for each q
    when `values` is empty. The one percentile helper of the project (timers, matrices, serving sweeps, /metrics)."""
    v = sorted(values)
    if not v:
        return tuple(float("nan") for _ in qs)
    out = []
    for q in qs:
        pos = (len(v) - 1) * q / 100.0
        lo = int(pos)
        hi = min(lo + 1, len(v) - 1)
        out.append(v[lo] + (v[hi] - v[lo]) * (pos - lo))
    return tuple(out)


@dataclass
class TimingRow:
    region: str
    stage: str
    layer: int  # -1 for regions outside the decoder layers
    calls: int
    total_ms: float
    p50_ms: float
    p90_ms: float


class RegionTimer:
    """Wall-clock time of regions and of the stages between their `split()` boundaries."""

    def __init__(self, enabled: bool = True, synchronize: Callable[[], None] | None = None) -> None:
        self.enabled = enabled
        self._sync = synchronize or (lambda: None)
        self._null = contextlib.nullcontext()
        self.samples: dict[tuple[str, str, int], list[float]] = defaultdict(list)  # seconds
        self._cur: tuple[str, int] | None = None
        self._last = 0.0

    def region(self, name: str, layer: int | None = None) -> contextlib.AbstractContextManager[Any]:
        if not self.enabled:
            return self._null
        return self._region(name, -1 if layer is None else layer)

    @contextlib.contextmanager
    def _region(self, name: str, layer: int) -> Iterator[RegionTimer]:
        outer = (self._cur, self._last)
        self._sync()
        self._cur, self._last = (name, layer), time.perf_counter()
        try:
            yield self
        finally:
            self._sync()
            self.samples[(name, REST, layer)].append(time.perf_counter() - self._last)
            self._cur, self._last = outer

    def split(self, stage: str) -> None:
        """End the current stage of the current region and name it `stage`."""
        if not self.enabled or self._cur is None:
            return
        self._sync()
        now = time.perf_counter()
        region, layer = self._cur
        self.samples[(region, stage, layer)].append(now - self._last)
        self._last = now

    def reset(self) -> None:
        self.samples.clear()

    def rows(self) -> list[TimingRow]:
        """One row per (region, stage, layer), in first-seen order."""
        out = []
        for (region, stage, layer), v in self.samples.items():
            ms = [s * 1e3 for s in v]
            out.append(TimingRow(region, stage, layer, len(ms), sum(ms), *quantiles(ms, 50, 90)))
        return out
