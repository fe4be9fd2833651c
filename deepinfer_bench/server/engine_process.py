"""The engine loop in its own process (vLLM's API-server / engine-core split), an `EngineClient` like `EngineLoop`.

Why: in one process the HTTP event loop (parsing, writing one SSE chunk per token) and the engine thread share the
GIL, and the engine waits for it at every step boundary (`deepinfer:engine_gap_seconds_total`). Here the child
process owns the engine (and with it detokenization and stop strings) and runs an `EngineLoop` whose step outputs
go to the pipe; the server process keeps the per-request sinks, a reader thread turns each step's outputs into one
`call_soon_threadsafe`, and a writer thread keeps pipe writes (large prompts) off the event loop.

Wire: the frozen dataclasses of deepinfer_bench/server/engine_messages.py, pickled. Server -> engine: `AddRequest`,
`AbortRequest`, `Shutdown`. Engine -> server: `Ready`, then `Added` / `Rejected` per add, `StepOutputs` per step,
`EngineDead` when the engine fails.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import multiprocessing as mp
import os
import queue
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from deepinfer_bench.server.engine_client import EngineClient, EngineDeadError, LoopStats, Sink
from deepinfer_bench.server.engine_messages import (
    AbortRequest,
    Added,
    AddRequest,
    EngineDead,
    FromEngine,
    Ready,
    Rejected,
    Shutdown,
    StepOutput,
    StepOutputs,
    ToEngine,
)
from deepinfer_bench.server.engine_thread import EngineLoop

if TYPE_CHECKING:
    from engine.llm import LLMEngine
    from engine.sampler import SamplingParams


def _child_main(conn: Any, factory: Callable[..., LLMEngine] | None, args: tuple, coalesce_s: float,
                job_runner: Callable[..., Any] | None) -> None:
    # The parent decides when to stop: this process and the rank processes it starts (they inherit both) form their
    # own process group, which a terminal's Ctrl-C does not reach and the parent can end as one (`stop`, `_kill`).
    os.setpgid(0, 0)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        if job_runner is not None:  # e.g. engine.launch.run_job: serve_engine runs on rank 0 of cp ranks
            job_runner(*args, serve_engine, (conn, coalesce_s))
        else:
            serve_engine(factory(*args), conn, coalesce_s)
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        try:
            conn.send(EngineDead(f"engine failed: {e!r}"))
        except OSError:  # the server is gone
            pass
        return
    # Stopped as asked (its rank processes have ended): leave without the interpreter's teardown, which takes
    # seconds with torch loaded on a busy machine and would count against the server's bounded shutdown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def serve_engine(engine: LLMEngine, conn: Any, coalesce_s: float) -> None:
    """Serve `engine` over `conn` until told to stop (module level: it is pickled to rank 0 when cp > 1)."""
    send_lock = threading.Lock()

    def send(msg: FromEngine) -> None:
        with send_lock:
            conn.send(msg)

    loop = EngineLoop(engine, coalesce_s=coalesce_s, deliver=send)

    def answer(rid: str, fut: concurrent.futures.Future[str]) -> None:
        e = fut.exception()
        if isinstance(e, EngineDeadError):
            send(EngineDead(str(e)))
        else:
            send(Added(rid) if e is None else Rejected.of(rid, e))

    def reader() -> None:  # pipe -> the loop
        while True:
            try:
                msg: ToEngine = conn.recv()
            except (EOFError, OSError):
                msg = Shutdown()
            if isinstance(msg, AddRequest):
                loop.submit_add(msg).add_done_callback(lambda f, rid=msg.request_id: answer(rid, f))
            elif isinstance(msg, AbortRequest):
                loop.abort(msg.request_id)
            else:
                loop.request_stop()
                return

    loop.stats.engine = engine.stats()
    send(Ready(vocab_size=engine.vocab_size, max_model_len=engine.config.cache.max_model_len,
               stats=loop.stats.snapshot()))
    threading.Thread(target=reader, daemon=True).start()
    loop.run()
    if loop.error is not None:
        send(EngineDead(f"engine loop stopped: {loop.error!r}"))


class ProcessEngineLoop(EngineClient):
    """The `EngineClient` over an engine in a child process (which runs an `EngineLoop`)."""

    def __init__(self, factory: Callable[..., LLMEngine] | None, args: tuple = (), *, coalesce_s: float = 0.002,
                 job_runner: Callable[..., Any] | None = None) -> None:
        """The child builds `factory(*args)`, or calls `job_runner(*args, serve_engine, (conn, coalesce_s))`."""
        self.factory, self.args, self.coalesce_s, self.job_runner = factory, args, coalesce_s, job_runner
        self.stats = LoopStats()
        self.error: BaseException | None = None
        self.ready: Ready | None = None
        self._sinks: dict[str, Sink] = {}
        self._pending: dict[str, concurrent.futures.Future[str]] = {}
        self._lock = threading.Lock()
        self._outbox: queue.SimpleQueue[ToEngine | None] = queue.SimpleQueue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._proc: Any = None
        self._conn: Any = None
        self._stopping = False

    def launch(self, timeout_s: float = 1800.0) -> Ready:
        """Spawn the engine process and wait until its engine is built; returns its `Ready` message."""
        ctx = mp.get_context("spawn")  # no fork of a process holding torch threads
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_child_main, name="deepinfer-engine",
                                 args=(child, self.factory, self.args, self.coalesce_s, self.job_runner))
        self._proc.start()
        child.close()
        # Not a daemon (a job_runner may start rank processes), so make sure it never outlives this process.
        atexit.register(self._kill)
        if not self._conn.poll(timeout_s):
            self._kill()
            raise RuntimeError(f"engine process did not start within {timeout_s}s")
        try:
            msg: FromEngine = self._conn.recv()
        except EOFError:
            msg = EngineDead("engine process exited before it was ready")
        if not isinstance(msg, Ready):
            self._proc.join(5)
            raise RuntimeError(msg.message if isinstance(msg, EngineDead) else f"unexpected first message {msg!r}")
        self.ready = msg
        self.stats.apply(msg.stats)
        return msg

    def _kill(self) -> None:
        """SIGKILL the engine process and the rank processes it started (its process group)."""
        if self._proc is None or not self._proc.is_alive():
            return
        try:
            os.killpg(self._proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):  # not (yet) its own group leader
            self._proc.kill()
        self._proc.join(5)

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.is_alive() and self.error is None and not self._stopping

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._proc is None:
            self.launch()
        self._loop = loop
        threading.Thread(target=self._read, name="engine-reader", daemon=True).start()
        threading.Thread(target=self._write, name="engine-writer", daemon=True).start()

    def stop(self, timeout: float = 10.0) -> bool:
        """Ask the engine to stop after its current step; past `timeout` s, kill it (and its rank processes).
        True if it ended by itself."""
        self._stopping = True
        self._outbox.put(Shutdown())
        self._outbox.put(None)
        if self._proc is None:
            return True
        self._proc.join(timeout)
        if not self._proc.is_alive():
            return True
        self._kill()
        return False

    async def add(self, prompt_token_ids: Sequence[int], params: SamplingParams, request_id: str,
                  sink: Sink) -> str:
        fut: concurrent.futures.Future[str] = concurrent.futures.Future()
        with self._lock:
            if not self.alive:
                raise EngineDeadError(f"engine process is not running: {self.error!r}")
            self._sinks[request_id] = sink
            self._pending[request_id] = fut
        self._outbox.put(AddRequest(request_id, tuple(prompt_token_ids), params))
        return await asyncio.wrap_future(fut)

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._sinks.pop(request_id, None)
        self._outbox.put(AbortRequest(request_id))

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
                msg: FromEngine = self._conn.recv()
            except (EOFError, OSError):
                msg = EngineDead("engine process exited")
            if isinstance(msg, StepOutputs):
                self.stats.apply(msg.stats)
                batch: list[tuple[Sink, StepOutput | EngineDeadError]] = []
                with self._lock:
                    for out in msg.outputs:
                        rid = out.request_id
                        sink = self._sinks.pop(rid, None) if out.finished else self._sinks.get(rid)
                        if sink is not None:
                            batch.append((sink, out))
                self._dispatch(batch)
            elif isinstance(msg, Added):
                with self._lock:
                    fut = self._pending.pop(msg.request_id, None)
                _resolve(fut, result=msg.request_id)
            elif isinstance(msg, Rejected):
                with self._lock:
                    self._sinks.pop(msg.request_id, None)
                    fut = self._pending.pop(msg.request_id, None)
                _resolve(fut, error=msg.error())
            elif isinstance(msg, EngineDead):
                self._die(msg.message)
                return
            else:
                self._die(f"unexpected message from the engine process: {msg!r}")
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


def _resolve(fut: concurrent.futures.Future | None, *, result: Any = None, error: BaseException | None = None) -> None:
    if fut is None or fut.done():  # cancelled by a client that went away
        return
    try:
        fut.set_exception(error) if error is not None else fut.set_result(result)
    except concurrent.futures.InvalidStateError:
        pass
