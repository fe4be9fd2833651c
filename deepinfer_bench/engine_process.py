"""The engine loop in its own process (vLLM's API-server / engine-core split), same interface as `EngineLoop`.

Why: in one process the HTTP event loop (parsing, detokenizing, writing one SSE chunk per token) and the engine
thread share the GIL, and the engine waits for it at every step boundary (`deepinfer:engine_gap_seconds_total`).
Here the child process owns the engine and runs an `EngineLoop` whose sinks write to a pipe; the server process
keeps the per-request sinks, a reader thread turns each step's outputs into one `call_soon_threadsafe`, and a
sender thread keeps pipe writes (large prompts) off the event loop.

Wire (pickled tuples). Parent -> child: ("add", ids, params, rid), ("abort", rid), ("stop",).
Child -> parent: ("ready", info), ("added", rid), ("rejected", rid, is_value_error, message),
("out", [(rid, new_token_ids, finished, finish_reason, prompt_len)], stats), ("dead", message).
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import dataclasses
import multiprocessing as mp
import queue
import signal
import threading
from collections.abc import Callable
from typing import Any

from deepinfer_bench.engine_loop import EngineDeadError, EngineLoop, LoopStats, Sink, _run_sinks


@dataclasses.dataclass(frozen=True)
class StepOutput:
    """What the server reads of a RequestOutput (the full output ids are not shipped every step)."""

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    prompt_len: int


_STAT_FIELDS = [f.name for f in dataclasses.fields(LoopStats) if f.name != "recent_step_s"]


def _child_main(conn: Any, factory: Callable[..., Any], args: tuple, coalesce_s: float,
                job_runner: Callable[..., Any] | None) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when to stop
    try:
        if job_runner is not None:  # e.g. engine.launch.run_job: serve_engine runs on rank 0 of cp ranks
            job_runner(*args, serve_engine, (conn, coalesce_s))
        else:
            serve_engine(factory(*args), conn, coalesce_s)
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        conn.send(("dead", f"engine failed: {e!r}"))


def serve_engine(engine: Any, conn: Any, coalesce_s: float) -> None:
    """Serve `engine` over `conn` until told to stop (module level: it is pickled to rank 0 when cp > 1)."""
    runner = getattr(engine, "runner", None)
    info = {"vocab_size": getattr(engine, "vocab_size", None),
            "max_model_len": getattr(runner, "max_model_len", None) or getattr(engine, "max_model_len", None)}
    send_lock = threading.Lock()

    def send(msg: tuple) -> None:
        with send_lock:
            conn.send(msg)

    def deliver(batch: list[tuple[Any, Any]]) -> None:
        outs = [(o.request_id, list(o.new_token_ids), bool(o.finished), o.finish_reason, int(o.prompt_len))
                for _, o in batch if not isinstance(o, BaseException)]
        stats = {k: getattr(loop.stats, k) for k in _STAT_FIELDS}
        send(("out", outs, stats))

    loop = EngineLoop(engine, coalesce_s=coalesce_s, deliver=deliver)

    def added(rid: str, fut: concurrent.futures.Future) -> None:
        e = fut.exception()
        if isinstance(e, EngineDeadError):
            send(("dead", str(e)))
        else:
            send(("added", rid) if e is None else ("rejected", rid, isinstance(e, ValueError), str(e)))

    def reader() -> None:  # pipe -> the loop's command queue
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                msg = ("stop",)
            if msg[0] == "add":
                _, ids, params, rid = msg
                fut: concurrent.futures.Future = concurrent.futures.Future()
                fut.add_done_callback(lambda f, rid=rid: added(rid, f))
                loop._cmds.put(("add", (ids, params, rid, rid, fut)))
            elif msg[0] == "abort":
                loop._cmds.put(("abort", msg[1]))
            else:
                loop._cmds.put(("stop", None))
                return

    send(("ready", info))
    threading.Thread(target=reader, daemon=True).start()
    loop._run()
    if loop.error is not None:
        send(("dead", f"engine loop stopped: {loop.error!r}"))


class ProcessEngineLoop:
    """`EngineLoop`'s interface (start/stop/add/abort/alive/error/stats) over an engine in a child process."""

    def __init__(self, factory: Callable[..., Any] | None, args: tuple = (), *, coalesce_s: float = 0.002,
                 job_runner: Callable[..., Any] | None = None) -> None:
        """The child builds `factory(*args)`, or calls `job_runner(*args, serve_engine, (conn, coalesce_s))`."""
        self.factory, self.args, self.coalesce_s, self.job_runner = factory, args, coalesce_s, job_runner
        self.stats = LoopStats()
        self.error: BaseException | None = None
        self.info: dict[str, Any] = {}
        self._sinks: dict[str, Sink] = {}
        self._pending: dict[str, concurrent.futures.Future[str]] = {}
        self._lock = threading.Lock()
        self._outbox: queue.SimpleQueue[tuple | None] = queue.SimpleQueue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._proc: Any = None
        self._conn: Any = None
        self._stopping = False

    def launch(self, timeout_s: float = 1800.0) -> dict[str, Any]:
        """Spawn the engine process and wait until its engine is built; returns {vocab_size, max_model_len}."""
        ctx = mp.get_context("spawn")  # no fork of a process holding torch threads
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_child_main, name="deepinfer-engine",
                                 args=(child, self.factory, self.args, self.coalesce_s, self.job_runner))
        self._proc.start()
        child.close()
        # Not a daemon (a job_runner may start rank processes), so make sure it never outlives this process.
        atexit.register(self._kill)
        if not self._conn.poll(timeout_s):
            self._proc.kill()
            raise RuntimeError(f"engine process did not start within {timeout_s}s")
        msg = self._conn.recv()
        if msg[0] != "ready":
            self._proc.join(5)
            raise RuntimeError(msg[1])
        self.info = msg[1]
        return self.info

    def _kill(self) -> None:
        if self._proc is not None and self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5)

    @property
    def alive(self) -> bool:
        return (self._proc is not None and self._proc.is_alive() and self.error is None and not self._stopping)

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._proc is None:
            self.launch()
        self._loop = loop
        threading.Thread(target=self._read, name="engine-reader", daemon=True).start()
        threading.Thread(target=self._write, name="engine-writer", daemon=True).start()

    def stop(self, timeout: float = 10.0) -> None:
        self._stopping = True
        self._outbox.put(("stop",))
        self._outbox.put(None)
        if self._proc is not None:
            self._proc.join(timeout)
            if self._proc.is_alive():
                self._proc.kill()
                self._proc.join(5)

    async def add(self, prompt_token_ids: list[int], params: Any, request_id: str, sink: Sink) -> str:
        fut: concurrent.futures.Future[str] = concurrent.futures.Future()
        with self._lock:
            if not self.alive:
                raise EngineDeadError(f"engine process is not running: {self.error!r}")
            self._sinks[request_id] = sink
            self._pending[request_id] = fut
        self._outbox.put(("add", list(prompt_token_ids), params, request_id))
        return await asyncio.wrap_future(fut)

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._sinks.pop(request_id, None)
        self._outbox.put(("abort", request_id))

    # -- threads ----------------------------------------------------------------------------------------------------
    def _write(self) -> None:
        while (msg := self._outbox.get()) is not None:
            try:
                self._conn.send(msg)
            except (OSError, ValueError):
                return

    def _read(self) -> None:
        while True:
            try:
                msg = self._conn.recv()
            except (EOFError, OSError):
                msg = ("dead", "engine process exited")
            kind = msg[0]
            if kind == "out":
                _, outs, stats = msg
                steps_before = self.stats.num_steps
                for k, v in stats.items():
                    setattr(self.stats, k, v)
                if self.stats.num_steps > steps_before:
                    self.stats.recent_step_s.append(self.stats.last_step_s)
                batch = []
                with self._lock:
                    for rid, new, finished, reason, plen in outs:
                        sink = self._sinks.pop(rid, None) if finished else self._sinks.get(rid)
                        if sink is not None:
                            batch.append((sink, StepOutput(rid, new, finished, reason, plen)))
                self._dispatch(batch)
            elif kind == "added":
                with self._lock:
                    fut = self._pending.pop(msg[1], None)
                _resolve(fut, result=msg[1])
            elif kind == "rejected":
                _, rid, is_value_error, text = msg
                with self._lock:
                    self._sinks.pop(rid, None)
                    fut = self._pending.pop(rid, None)
                _resolve(fut, error=ValueError(text) if is_value_error else RuntimeError(text))
            elif kind == "dead":
                self._die(msg[1])
                return

    def _die(self, message: str) -> None:
        dead = EngineDeadError(message)
        with self._lock:
            if self.error is None and not self._stopping:
                self.error = dead
            sinks, self._sinks = list(self._sinks.values()), {}
            pending, self._pending = list(self._pending.values()), {}
        for fut in pending:
            _resolve(fut, error=dead)
        self._dispatch([(s, dead) for s in sinks])
        self._outbox.put(None)

    def _dispatch(self, batch: list[tuple[Sink, Any]]) -> None:
        if batch and self._loop is not None:
            try:
                self._loop.call_soon_threadsafe(_run_sinks, batch)
            except RuntimeError:  # event loop closed
                pass


def _resolve(fut: concurrent.futures.Future | None, *, result: Any = None, error: BaseException | None = None) -> None:
    if fut is None or fut.done():  # cancelled by a client that went away
        return
    try:
        fut.set_exception(error) if error is not None else fut.set_result(result)
    except concurrent.futures.InvalidStateError:
        pass
