"""One thread that owns the engine: it adds and aborts requests and runs `step()` for every in-flight request.

The event loop never touches the engine. It sends commands (add, abort, stop) through a thread-safe queue; the
engine thread applies them between steps, so requests join and leave the running batch between steps (continuous
batching), and hands each step's outputs to per-request sinks with ONE `loop.call_soon_threadsafe` per step (the
sinks run on the event loop). If `step()` raises, the loop is dead: every in-flight request gets the error and later
requests are refused (HTTP 503).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

Sink = Callable[[Any], None]  # run on the event loop with a RequestOutput or an EngineDeadError


class EngineDeadError(RuntimeError):
    """The engine loop has stopped (a step raised, or the server is shutting down)."""


@dataclasses.dataclass
class LoopStats:
    """A snapshot the engine thread refreshes after every step; read by /metrics without touching the engine."""

    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    num_kv_blocks_used: int = 0
    num_kv_blocks_total: int = 0
    num_steps: int = 0
    last_step_s: float = 0.0
    step_s_total: float = 0.0  # time inside engine.step()
    recent_step_s: collections.deque[float] = dataclasses.field(default_factory=lambda: collections.deque(maxlen=512))
    gap_s_total: float = 0.0  # time between two steps while work was pending (commands, dispatch, GIL waits)
    num_generated_tokens: int = 0  # engine's own count (-1 if it does not report one)
    num_preemptions: int = 0


def read_engine_stats(engine: Any) -> dict[str, float]:
    """Engine counters as a flat dict, whatever shape `engine.stats()` returns (dataclass, dict or attributes)."""
    fn = getattr(engine, "stats", None) or getattr(engine, "get_stats", None)
    raw = fn() if callable(fn) else fn
    if raw is None:
        return {}
    if dataclasses.is_dataclass(raw):
        raw = dataclasses.asdict(raw)
    elif not isinstance(raw, dict):
        raw = {k: getattr(raw, k) for k in dir(raw) if not k.startswith("_")}
    return {k: float(v) for k, v in raw.items() if isinstance(v, int | float) and not isinstance(v, bool)}


def _pick(stats: dict[str, float], *names: str, default: float = 0.0) -> float:
    for n in names:
        if n in stats:
            return stats[n]
    return default


class EngineLoop:
    """Runs `engine.step()` on a dedicated thread while the engine has unfinished requests."""

    def __init__(self, engine: Any, *, idle_poll_s: float = 0.5, coalesce_s: float = 0.002,
                 deliver: Callable[[list[tuple[Any, Any]]], None] | None = None) -> None:
        self.engine = engine
        self._deliver_fn = deliver  # None: run the sinks on the asyncio loop given to start()
        self.idle_poll_s = idle_poll_s
        # When idle, the first request waits until no other command arrived for `coalesce_s` (at most 4x that) so a
        # burst of arrivals is prefilled in one step instead of trickling in over several.
        self.coalesce_s = coalesce_s
        self.stats = LoopStats()
        self.error: BaseException | None = None
        self._cmds: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._sinks: dict[str, Sink] = {}  # engine thread only
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping = False
        self._closed = False  # set by the engine thread on exit, under _lock, so no add can be left unanswered
        self._lock = threading.Lock()

    # -- event-loop side ------------------------------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None and not self._stopping

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start the engine thread; sinks will run on `loop`."""
        self._loop = loop
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping = True
        self._cmds.put(("stop", None))
        if self._thread is not None:
            self._thread.join(timeout)

    async def add(self, prompt_token_ids: list[int], params: Any, request_id: str, sink: Sink) -> str:
        """Add a request on the engine thread; re-raises what `engine.add_request` raised (e.g. RequestRejected)."""
        if not self.alive:
            raise EngineDeadError(f"engine loop is not running: {self.error!r}")
        fut: concurrent.futures.Future[str] = concurrent.futures.Future()
        with self._lock:
            if self._closed:
                raise EngineDeadError(f"engine loop is not running: {self.error!r}")
            self._cmds.put(("add", (prompt_token_ids, params, request_id, sink, fut)))
        return await asyncio.wrap_future(fut)

    def abort(self, request_id: str) -> None:
        """Abort a request (non-blocking); its sink gets nothing more and the engine frees its KV blocks."""
        self._cmds.put(("abort", request_id))

    # -- engine thread ----------------------------------------------------------------------------------------------
    def _apply(self, cmd: str, arg: Any) -> bool:
        if cmd == "stop":
            return False
        if cmd == "abort":
            if self._sinks.pop(arg, None) is not None:
                self.engine.abort(arg)
        elif cmd == "add":
            ids, params, rid, sink, fut = arg
            if not fut.set_running_or_notify_cancel():
                return True
            try:
                rid = self.engine.add_request(ids, params, request_id=rid)
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                fut.set_exception(e)
            else:
                self._sinks[rid] = sink
                fut.set_result(rid)
        return True

    def _drain(self, block: bool) -> bool:
        try:
            cmd, arg = self._cmds.get(timeout=self.idle_poll_s) if block else self._cmds.get_nowait()
        except queue.Empty:
            return True
        if not self._apply(cmd, arg):
            return False
        deadline = time.perf_counter() + 4 * self.coalesce_s if block else 0.0
        while True:
            wait = min(self.coalesce_s, deadline - time.perf_counter())
            try:
                cmd, arg = self._cmds.get(timeout=wait) if wait > 0 else self._cmds.get_nowait()
            except queue.Empty:
                return True
            if not self._apply(cmd, arg):
                return False

    def _snapshot(self) -> None:
        s = read_engine_stats(self.engine)
        st = self.stats
        st.num_running = int(_pick(s, "num_running", "running", "num_running_reqs"))
        st.num_waiting = int(_pick(s, "num_waiting", "waiting", "num_waiting_reqs"))
        st.num_kv_blocks_used = int(_pick(s, "num_used_blocks", "kv_blocks_used", "used_blocks", "num_kv_blocks_used"))
        st.num_kv_blocks_total = int(_pick(s, "num_total_blocks", "kv_blocks_total", "num_blocks", "num_kv_blocks"))
        default_usage = st.num_kv_blocks_used / st.num_kv_blocks_total if st.num_kv_blocks_total else 0.0
        st.kv_usage = _pick(s, "kv_usage", "kv_cache_usage", "kv_pool_usage", default=default_usage)
        st.num_generated_tokens = int(_pick(s, "num_generated_tokens", "generated_tokens", default=-1))
        st.num_preemptions = int(_pick(s, "num_preemptions", "preemptions"))

    def _deliver(self, batch: list[tuple[Sink, Any]]) -> None:
        if self._deliver_fn is not None:
            self._deliver_fn(batch)
            return
        if not batch or self._loop is None:
            return
        try:
            self._loop.call_soon_threadsafe(_run_sinks, batch)
        except RuntimeError:  # event loop closed (shutdown)
            pass

    def _run(self) -> None:
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
                        self._deliver_fn([])  # carries the fresh stats across a process boundary
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
                batch = []
                for out in outputs:
                    sink = self._sinks.get(out.request_id)
                    if sink is None:
                        continue  # aborted by the server meanwhile
                    if out.finished:
                        del self._sinks[out.request_id]
                    batch.append((sink, out))
                self._snapshot()
                self._deliver(batch)
        except BaseException as e:  # noqa: BLE001 - the loop is dead; tell everyone waiting
            self.error = e
        dead = EngineDeadError(f"engine loop stopped: {self.error!r}" if self.error else "server shutting down")
        with self._lock:
            self._closed = True
        self._deliver([(sink, dead) for sink in self._sinks.values()])
        self._sinks.clear()
        while True:  # refuse adds that raced with the shutdown
            try:
                cmd, arg = self._cmds.get_nowait()
            except queue.Empty:
                break
            if cmd == "add" and arg[4].set_running_or_notify_cancel():
                arg[4].set_exception(dead)


def _run_sinks(batch: list[tuple[Sink, Any]]) -> None:
    for sink, item in batch:
        sink(item)
