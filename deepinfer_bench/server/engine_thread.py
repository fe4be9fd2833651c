"""One thread that owns the engine: it adds and aborts requests and runs `step()` for every in-flight request.

The event loop never touches the engine. It submits commands (`AddRequest`, `AbortRequest`, `Shutdown`) through a
thread-safe queue; the engine thread applies them between steps, so requests join and leave the running batch
between steps (continuous batching), and hands each step's `StepOutput`s to per-request sinks with ONE
`loop.call_soon_threadsafe` per step (the sinks run on the event loop). If `step()` raises, the loop is dead:
every in-flight request gets an `EngineDeadError` and later requests are refused (HTTP 503).

The `EngineClient` interface (engine_client.py), plus `run()` (the loop on the current thread), `submit_add` (from any
thread) and `request_stop`. The engine process (engine_process.py) runs the
same loop with `deliver=`: each step's outputs go to that callback as one `StepOutputs` instead of to sinks.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Union

from deepinfer_bench.server.engine_client import EngineClient, EngineDeadError, LoopStats, Sink
from deepinfer_bench.server.engine_messages import (
    AbortRequest,
    AddRequest,
    Shutdown,
    StepOutput,
    StepOutputs,
)

if TYPE_CHECKING:
    from engine.llm import LLMEngine
    from engine.sampler import SamplingParams


Deliver = Callable[[StepOutputs], None]  # runs on the engine thread


@dataclasses.dataclass(frozen=True)
class _Add:
    """An `AddRequest` with where its outputs go and where its answer goes (the request id, or the error)."""

    request: AddRequest
    sink: Sink | None
    future: concurrent.futures.Future[str]


_Command = Union[_Add, AbortRequest, Shutdown]


class EngineLoop(EngineClient):
    """Runs `engine.step()` on one thread while the engine has unfinished requests (an `EngineClient`)."""

    def __init__(self, engine: LLMEngine, *, idle_poll_s: float = 0.5, coalesce_s: float = 0.002,
                 deliver: Deliver | None = None) -> None:
        """`deliver`: called on the engine thread with every step's `StepOutputs` (and after an abort emptied the
        engine, to carry fresh stats); None: each output goes to its request's sink on the asyncio loop."""
        self.engine = engine
        self._deliver_fn = deliver
        self.idle_poll_s = idle_poll_s
        # When idle, the first request waits until no other command arrived for `coalesce_s` (at most 4x that) so a
        # burst of arrivals is prefilled in one step instead of trickling in over several.
        self.coalesce_s = coalesce_s
        self.stats = LoopStats()
        self.error: BaseException | None = None
        self._cmds: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._sinks: dict[str, Sink | None] = {}  # live requests (engine thread only)
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._started = False
        self._stopping = False
        self._closed = False  # set by the engine thread on exit, under _lock, so no add can be left unanswered
        self._lock = threading.Lock()

    # -- any thread -------------------------------------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        return self._started and not self._closed and self.error is None and not self._stopping

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Run the loop on a new thread; sinks will run on `loop`."""
        self._loop = loop
        self._started = True
        self._thread = threading.Thread(target=self.run, name="engine-loop", daemon=True)
        self._thread.start()

    def request_stop(self) -> None:
        """Ask the loop to stop after the current step (non-blocking); in-flight requests get EngineDeadError."""
        self._stopping = True
        self._cmds.put(Shutdown())

    def stop(self, timeout: float = 10.0) -> bool:
        """Stop after the current step; True if the loop ended within `timeout` s (else its daemon thread ends with
        the process)."""
        self.request_stop()
        if self._thread is not None:
            self._thread.join(timeout)
            return not self._thread.is_alive()
        return True

    def submit_add(self, request: AddRequest, sink: Sink | None = None) -> concurrent.futures.Future[str]:
        """Queue a request for the engine thread. The future gets the request id, or what `engine.add_request`
        raised (e.g. RequestRejected), or EngineDeadError once the loop has exited."""
        fut: concurrent.futures.Future[str] = concurrent.futures.Future()
        with self._lock:
            if self._closed:
                fut.set_exception(self._dead_error())
            else:
                self._cmds.put(_Add(request, sink, fut))
        return fut

    async def add(self, prompt_token_ids: Sequence[int], params: SamplingParams, request_id: str,
                  sink: Sink) -> str:
        """Add a request on the engine thread; re-raises what `engine.add_request` raised (e.g. RequestRejected)."""
        if not self.alive:
            raise EngineDeadError(f"engine loop is not running: {self.error!r}")
        fut = self.submit_add(AddRequest(request_id, tuple(prompt_token_ids), params), sink)
        return await asyncio.wrap_future(fut)

    def abort(self, request_id: str) -> None:
        self._cmds.put(AbortRequest(request_id))

    # -- the engine thread --------------------------------------------------------------------------------------------
    def run(self) -> None:
        """Run the loop on the current thread until `request_stop()` or a failed step (then `error` is set)."""
        self._started = True
        st = self.stats
        last_end: float | None = None
        try:
            self._snapshot()
            while True:
                idle = not self.engine.has_unfinished()
                if idle:
                    last_end = None  # waiting for work is not overhead
                if not self._drain(block=idle):
                    break
                if not self.engine.has_unfinished():
                    self._snapshot()  # an abort may have emptied the engine
                    if self._deliver_fn is not None:
                        self._deliver_fn(StepOutputs((), st.snapshot()))  # the fresh stats, across a process
                    continue
                t0 = time.perf_counter()
                if last_end is not None:
                    st.gap_s_total += t0 - last_end
                outputs = self.engine.step()
                last_end = time.perf_counter()
                st.last_step_s = last_end - t0
                st.step_s_total += st.last_step_s
                st.recent_step_s.append(st.last_step_s)
                st.num_steps += 1
                batch: list[tuple[Sink | None, StepOutput]] = []
                for out in outputs:
                    if out.request_id not in self._sinks:
                        continue  # aborted by the server meanwhile
                    sink = self._sinks.pop(out.request_id) if out.finished else self._sinks[out.request_id]
                    batch.append((sink, StepOutput.of(out)))
                self._snapshot()
                self._deliver(batch)
        except BaseException as e:  # noqa: BLE001 - the loop is dead; tell everyone waiting
            self.error = e
        dead = self._dead_error()
        with self._lock:
            self._closed = True
        if self._deliver_fn is None:
            self._dispatch([(sink, dead) for sink in self._sinks.values() if sink is not None])
        self._sinks.clear()
        while True:  # refuse adds that raced with the shutdown
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                break
            if isinstance(cmd, _Add) and cmd.future.set_running_or_notify_cancel():
                cmd.future.set_exception(dead)

    def _dead_error(self) -> EngineDeadError:
        return EngineDeadError(f"engine loop stopped: {self.error!r}" if self.error else "server shutting down")

    def _apply(self, cmd: _Command) -> bool:
        """Apply one command; False for Shutdown."""
        if isinstance(cmd, Shutdown):
            return False
        if isinstance(cmd, AbortRequest):
            if cmd.request_id in self._sinks:
                del self._sinks[cmd.request_id]
                self.engine.abort(cmd.request_id)
        elif cmd.future.set_running_or_notify_cancel():  # _Add (not cancelled by a client that went away)
            req = cmd.request
            try:
                rid = self.engine.add_request(list(req.prompt_token_ids), req.params, request_id=req.request_id)
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                cmd.future.set_exception(e)
            else:
                self._sinks[rid] = cmd.sink
                cmd.future.set_result(rid)
        return True

    def _drain(self, block: bool) -> bool:
        try:
            cmd = self._cmds.get(timeout=self.idle_poll_s) if block else self._cmds.get_nowait()
        except queue.Empty:
            return True
        if not self._apply(cmd):
            return False
        deadline = time.perf_counter() + 4 * self.coalesce_s if block else 0.0
        while True:
            wait = min(self.coalesce_s, deadline - time.perf_counter())
            try:
                cmd = self._cmds.get(timeout=wait) if wait > 0 else self._cmds.get_nowait()
            except queue.Empty:
                return True
            if not self._apply(cmd):
                return False

    def _snapshot(self) -> None:
        self.stats.engine = self.engine.stats()

    def _deliver(self, batch: list[tuple[Sink | None, StepOutput]]) -> None:
        if self._deliver_fn is not None:
            self._deliver_fn(StepOutputs(tuple(out for _, out in batch), self.stats.snapshot()))
        else:
            self._dispatch([(sink, out) for sink, out in batch if sink is not None])
