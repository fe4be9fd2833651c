"""Wall time of every native entry point (`dk_*`) of a loaded host-kernel library, while installed: where a host
decode step's time goes between the native kernels and the Python / torch around them (`deepinfer regions
--timing` on the host table; deepinfer_bench/bench/region_timing.py).

`NativeClock(lib).install()` puts a proxy in place of `lib.lib` (the ctypes library every wrapper calls through):
each `dk_*` call is counted and timed with `time.perf_counter` around the ctypes call (~0.3 us a call, ~100 calls a
decode step); `remove()` puts the library back. A native call that runs others (the MoE FFN's GEMMs, the attention
front's) counts once, under its own name. Under `--cp` each rank process has its own library and clock.
"""

from __future__ import annotations

import time
from collections import Counter, defaultdict
from collections.abc import Callable
from typing import Any

from engine.host_kernels.build import HostLibrary


class _TimedLib:
    """The ctypes library with every `dk_*` function wrapped by `clock` (made on first use); anything else as is."""

    def __init__(self, lib: Any, clock: NativeClock) -> None:
        self._lib, self._clock = lib, clock

    def __getattr__(self, name: str) -> Any:
        f = getattr(self._lib, name)
        if not name.startswith("dk_") or name in ("dk_max_threads", "dk_last_threads"):
            return f
        calls, seconds = self._clock.calls, self._clock.seconds

        def timed(*args: Any, _f: Callable[..., Any] = f, _name: str = name) -> Any:
            t0 = time.perf_counter()
            try:
                return _f(*args)
            finally:
                seconds[_name] += time.perf_counter() - t0
                calls[_name] += 1

        setattr(self, name, timed)  # the next lookup finds it without __getattr__
        return timed


class NativeClock:
    """Calls and seconds per native entry point of `lib` while installed."""

    def __init__(self, lib: HostLibrary) -> None:
        self.lib = lib
        self.calls: Counter[str] = Counter()
        self.seconds: defaultdict[str, float] = defaultdict(float)
        self._real: Any = None

    def install(self) -> NativeClock:
        if self._real is None:
            self._real = self.lib.lib
            self.lib.lib = _TimedLib(self._real, self)
        return self

    def remove(self) -> None:
        if self._real is not None:
            self.lib.lib, self._real = self._real, None

    def rows(self) -> list[dict[str, Any]]:
        """[{"kernel", "calls", "total_ms"}] by time, largest first."""
        return [{"kernel": k, "calls": self.calls[k], "total_ms": self.seconds[k] * 1e3}
                for k in sorted(self.seconds, key=lambda k: -self.seconds[k])]
