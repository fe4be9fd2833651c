"""What the server needs of an engine: `EngineClient`, the one interface both engine loops implement (EngineLoop:
a thread in this process, engine_thread.py; ProcessEngineLoop: a child process, engine_process.py), and what
crosses it (a request's sink, `EngineDeadError`, the `LoopStats` /metrics reads)."""

from __future__ import annotations

import abc
import asyncio
import collections
import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Union

from deepinfer_bench.server.engine_messages import LoopSnapshot, StepOutput, empty_engine_stats
from engine.llm import EngineStats

if TYPE_CHECKING:
    from engine.sampler import SamplingParams


class EngineDeadError(RuntimeError):
    """The engine loop has stopped (a step raised, or the server is shutting down)."""


Sink = Callable[[Union[StepOutput, EngineDeadError]], None]  # runs on the event loop


@dataclasses.dataclass
class LoopStats:
    """The loop's view for /metrics: the engine's `EngineStats` as of the last step and the loop's step timing.
    Refreshed by the engine thread after every step (or from each `StepOutputs` in the server process)."""

    engine: EngineStats = dataclasses.field(default_factory=empty_engine_stats)
    num_steps: int = 0
    last_step_s: float = 0.0
    step_s_total: float = 0.0  # time inside engine.step()
    gap_s_total: float = 0.0  # time between two steps while work was pending (commands, dispatch, GIL waits)
    recent_step_s: collections.deque[float] = dataclasses.field(default_factory=lambda: collections.deque(maxlen=512))

    def snapshot(self) -> LoopSnapshot:
        return LoopSnapshot(self.engine, self.num_steps, self.last_step_s, self.step_s_total, self.gap_s_total)

    def apply(self, snap: LoopSnapshot) -> None:
        """Take over a snapshot sent after each step (so `recent_step_s` gets every step's time)."""
        if snap.num_steps > self.num_steps:
            self.recent_step_s.append(snap.last_step_s)
        self.engine, self.num_steps, self.last_step_s = snap.engine, snap.num_steps, snap.last_step_s
        self.step_s_total, self.gap_s_total = snap.step_s_total, snap.gap_s_total


class EngineClient(abc.ABC):
    """The server's side of an engine loop: requests in (`add`, `abort`), each request's outputs out to its sink on
    the event loop, one step's outputs in one call (`_dispatch`); `start` / `stop` with the app; what /health and
    /metrics read (`alive`, `error`, `stats`). A loop that leaves out a method fails at construction."""

    stats: LoopStats
    error: BaseException | None  # why the loop died (None while it runs or after a clean stop)
    _loop: asyncio.AbstractEventLoop | None  # where sinks run; set by `start`

    @property
    @abc.abstractmethod
    def alive(self) -> bool:
        """Taking requests: started, not stopping, and no failed step."""

    @abc.abstractmethod
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start the loop; sinks will run on `loop`."""

    @abc.abstractmethod
    def stop(self, timeout: float = 10.0) -> bool:
        """Stop after the current step; True if the loop ended within `timeout` s. In-flight requests get
        EngineDeadError."""

    @abc.abstractmethod
    async def add(self, prompt_token_ids: Sequence[int], params: SamplingParams, request_id: str,
                  sink: Sink) -> str:
        """Add a request; its outputs go to `sink`. Re-raises what `engine.add_request` raised (e.g.
        RequestRejected); EngineDeadError when the loop is not running."""

    @abc.abstractmethod
    def abort(self, request_id: str) -> None:
        """Abort a request (non-blocking); its sink gets nothing more and the engine frees its KV blocks."""

    def _dispatch(self, batch: list[tuple[Sink, StepOutput | EngineDeadError]]) -> None:
        """Hand one step's outputs to their sinks with one `call_soon_threadsafe` (from the loop's own thread)."""
        if not batch or self._loop is None:
            return
        try:
            self._loop.call_soon_threadsafe(run_sinks, batch)
        except RuntimeError:  # event loop closed (shutdown)
            pass


def run_sinks(batch: list[tuple[Sink, StepOutput | EngineDeadError]]) -> None:
    """Run each sink with its item (on the event loop: one call per step for the whole batch)."""
    for sink, item in batch:
        sink(item)
