"""`deepinfer serve` as library calls: the port, the engine and app, uvicorn with a bounded drain at shutdown.

`serve(config, options, say)` does it all in the order that keeps failures cheap:
1. `bind_port`: the listening address is bound before anything loads, so a busy port is one clear error
   (`PortUnavailable`) in a second, not after minutes of loading. The bound socket is handed to uvicorn (no race
   between a check and a later bind); it listens only once the engine is ready, so clients see "connection
   refused" while the model loads, as before.
2. `build_app`: the engine (in a child process by default; on cp rank processes for cp > 1) and the FastAPI app.
3. `run_app`: uvicorn until SIGTERM / SIGINT, then `DrainingServer`'s shutdown: stop accepting (listener closed,
   idle keep-alive connections closed, new requests on open connections 503, /health 503), let the open requests
   finish for up to `drain_timeout_s`, then end those still open (a stream: an SSE error event and `data: [DONE]`;
   a non-streamed request: a 503), stop the engine (its process and its rank processes; killed if they take more
   than 1.5 s), return. `deepinfer serve` then exits 0 (at once: `exit_when_done`), no traceback in the log. A
   second SIGINT forces the exit (uvicorn's rule).
"""

from __future__ import annotations

import asyncio
import errno
import hashlib
import json
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import uvicorn

from engine.config import Workload

if TYPE_CHECKING:
    from deepinfer_bench.server.runs import Replies

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")
# After the drain, the open replies are ended; a client that does not read its reply (so the end of it cannot be
# written) is disconnected this much later, and uvicorn's own last resort (cancel the request tasks) comes after.
CUT_AFTER_END_S = 1.0
log = logging.getLogger("uvicorn.error")


class ServeError(Exception):
    """`deepinfer serve` cannot start: one line for the user."""


class PortUnavailable(ServeError):
    """The address cannot be bound (in use, not permitted, not a local address)."""


class EngineStartFailed(ServeError):
    """The engine process could not build the engine (bad checkpoint, a rank that died, ...)."""


@dataclass(frozen=True)
class ServeOptions:
    host: str = "127.0.0.1"
    port: int = 8000  # 0: a free port chosen by the system (reported by `say`)
    served_model_name: str | None = None
    api_key: str | None = None
    engine_process: bool = True  # the engine in a child process (else on a thread of the server)
    drain_timeout_s: float = 5.0  # at shutdown, how long open requests may still run
    log_level: str = "info"
    # After the shutdown, end the process at once (the engine is stopped, the logs flushed) instead of through the
    # interpreter's teardown, which takes seconds with torch loaded on a busy machine (the `deepinfer serve` process).
    exit_when_done: bool = False


def bind_port(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port), not yet listening; `PortUnavailable` with one line if it cannot be."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                          flags=socket.AI_PASSIVE)[0]
    except (socket.gaierror, UnicodeError) as e:
        raise PortUnavailable(f"cannot serve on {host}:{port}: {getattr(e, 'strerror', None) or e}") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a restart need not wait for TIME_WAIT
    try:
        sock.bind(addr)
    except OSError as e:
        sock.close()
        raise PortUnavailable(_bind_error(host, port, e)) from None
    return sock


def _bind_error(host: str, port: int, e: OSError) -> str:
    if e.errno == errno.EADDRINUSE:
        return f"port {port} on {host} is already in use (another server listens there; pick another --port)"
    if e.errno == errno.EACCES:
        return f"port {port} on {host}: permission denied (ports below 1024 need privileges)"
    return f"cannot serve on {host}:{port}: {e.strerror or e}"


def listen(sock: socket.socket, host: str, port: int, backlog: int = 2048) -> None:
    """Start listening on a bound socket (another process may have taken the port while the model loaded)."""
    try:
        sock.listen(backlog)
    except OSError as e:
        raise PortUnavailable(_bind_error(host, port, e)) from None


# ---- the engine and the app ----------------------------------------------------------------------------------------
def tokenizer_root(model_dir: str | Path) -> Path:
    """The directory `/v1/models` reports as `root`: where a client (vLLM's `get_tokenizer` -> HF `AutoTokenizer`)
    loads the tokenizer from.

    That is the model directory itself when its config.json is HF-format. An official-format config.json (no
    `model_type`, `"dtype": "fp8"`) makes `AutoTokenizer.from_pretrained` fail while parsing the config, so then
    the tokenizer files are copied once into a tokenizer-only directory (keyed by their content) and that is `root`.
    """
    model_dir = Path(model_dir).resolve()
    cfg_path = model_dir / "config.json"
    if not (model_dir / "tokenizer.json").exists():
        return model_dir
    if cfg_path.exists() and "model_type" in json.loads(cfg_path.read_text()):
        return model_dir
    files = [model_dir / f for f in TOKENIZER_FILES if (model_dir / f).exists()]
    keyed = files + ([cfg_path] if cfg_path.exists() else [])  # the HF config.json written below derives from it
    digest = hashlib.sha256(b"".join(f.name.encode() + f.read_bytes() for f in keyed)).hexdigest()[:16]
    out = Path(tempfile.gettempdir()) / "deepinfer-tokenizers" / f"{model_dir.name}-{digest}"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
        for f in files:
            shutil.copyfile(f, tmp / f.name)
        _write_hf_config(cfg_path, tmp / "config.json")
        try:
            tmp.rename(out)
        except OSError:  # another server made it first
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def _write_hf_config(official: Path, out: Path) -> None:
    """Clients (vLLM's `get_config`) look for an HF config.json beside the tokenizer: write the HF spelling of the
    model's config there (skipped if the config cannot be read; the server itself reports that error)."""
    from engine.config import ConfigError, ModelConfig

    try:
        hf = {"model_type": "deepseek_v4", "architectures": ["DeepseekV4ForCausalLM"],
              **ModelConfig.from_json(official).to_hf_json()}
    except (ConfigError, OSError):
        return
    out.write_text(json.dumps(hf, indent=1) + "\n")


def build_serving_engine(config: Any) -> Any:
    """The engine for serving (in the engine process): the process set up by the config's backend (threads,
    Neuron runtime variables), the fixed KV pool, and the weights loaded before the first request so its TTFT
    does not include loading. The engine never runs MTP while serving."""
    import engine

    return engine.build(config)


def workload() -> Workload:
    """Serving defaults: 32 slots, sequences up to 4096 tokens (the model's limit if lower), 2048 tokens per step, a
    pool of 8192 token positions (or one longest sequence); the block size follows cp (engine/config.py)."""
    return Workload(max_num_seqs=32, max_model_len=4096, pool_tokens=8192, max_num_batched_tokens=2048)


def build_app(config: Any, *, served_model_name: str | None, api_key: str | None, engine_process: bool = True) -> Any:
    """The server app. `engine_process`: the engine runs in a child process (no GIL shared with the HTTP side),
    else on a thread of this process. RuntimeError when the engine process could not build the engine."""
    from deepinfer_bench.server.api import create_app
    from deepinfer_bench.server.settings import ServerConfig
    from engine.sampler import SamplingParams
    from engine.tokenizer import load_tokenizer

    model_dir = Path(config.model.model_dir).resolve()
    engine, loop = None, None
    if engine_process:
        from deepinfer_bench.server.engine_process import ProcessEngineLoop

        if config.cp > 1:  # rank 0 of cp ranks schedules and serves; the others execute its steps (engine/launch.py)
            import functools
            import math

            from engine.launch import run_job

            loop = ProcessEngineLoop(None, (config,), job_runner=functools.partial(run_job, timeout_s=math.inf))
        else:
            loop = ProcessEngineLoop(build_serving_engine, (config,))
        ready = loop.launch()
        tokenizer = load_tokenizer(model_dir)
        vocab_size, max_model_len = ready.vocab_size, ready.max_model_len
    else:
        engine = build_serving_engine(config)
        tokenizer, vocab_size = engine.tokenizer, engine.vocab_size
        max_model_len = config.cache.max_model_len
    scfg = ServerConfig(served_model_name=served_model_name or model_dir.name,
                        model_root=str(tokenizer_root(model_dir)), model_aliases=(str(model_dir),),
                        max_model_len=min(max_model_len, config.cache.max_model_len),
                        vocab_size=vocab_size, api_key=api_key)
    return create_app(engine, tokenizer, scfg, make_sampling_params=SamplingParams, engine_loop=loop)


# ---- running it ----------------------------------------------------------------------------------------------------
class DrainingServer(uvicorn.Server):
    """uvicorn's server whose shutdown drains for a bounded time (see the module docstring).

    uvicorn's own shutdown stops accepting, asks every connection to close after its current reply, waits for
    them up to `timeout_graceful_shutdown`, then cancels what is left (a traceback per request) and stops the app
    (lifespan: the engine). Around it this class tells the app to refuse new requests at once, to end the open ones
    after `drain_timeout_s`, and disconnects the clients that still have not taken their replies a second later,
    so uvicorn's cancel (set later still) never fires on a server whose clients read."""

    def __init__(self, config: uvicorn.Config, replies: Replies, drain_timeout_s: float) -> None:
        super().__init__(config)
        self.replies, self.drain_timeout_s = replies, drain_timeout_s

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        loop = asyncio.get_running_loop()
        n = self.replies.stop_admitting()
        if n:
            log.info("Draining %d open request(s) for up to %g s", n, self.drain_timeout_s)
        timers = [loop.call_later(self.drain_timeout_s, self._end_open),
                  loop.call_later(self.drain_timeout_s + CUT_AFTER_END_S, self._disconnect)]
        try:
            await super().shutdown(sockets)
        finally:
            for t in timers:
                t.cancel()

    def _end_open(self) -> None:
        n = self.replies.end_open(f"the request was still running after the {self.drain_timeout_s:g} s drain")
        if n:
            log.warning("Ended %d request(s) still open after the %g s drain (streams: an error event and [DONE]; "
                        "others: 503)", n, self.drain_timeout_s)

    def _disconnect(self) -> None:
        stuck = [c for c in self.server_state.connections if getattr(c, "transport", None) is not None]
        if stuck:
            log.warning("Disconnecting %d client(s) that did not read the end of their reply", len(stuck))
        for c in stuck:
            c.transport.abort()


def run_app(app: Any, sock: socket.socket, *, drain_timeout_s: float = 5.0, log_level: str = "info") -> None:
    """Serve `app` on the bound `sock` until SIGTERM / SIGINT, drain, stop the engine and return."""
    config = uvicorn.Config(app, log_level=log_level, timeout_keep_alive=30,
                            timeout_graceful_shutdown=int(drain_timeout_s + CUT_AFTER_END_S + 2))
    server = DrainingServer(config, app.state.replies, drain_timeout_s)
    # uvicorn restores the signal handlers it found and then re-raises the signal that stopped it, so that the
    # process dies by it (exit -15). A drained server exits 0: the handlers it finds ignore that re-raise.
    previous = {sig: signal.signal(sig, _after_drain) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.run(sockets=[sock])
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _after_drain(_sig: int, _frame: Any) -> None:
    """uvicorn re-raises the signal it drained on: the shutdown is done, nothing more to do."""


def serve(config: Any, options: ServeOptions, say: Callable[[str], None] = print) -> None:
    """`deepinfer serve`: bind, load, serve until SIGTERM / SIGINT, drain, stop. `say` gets the progress lines.
    Raises PortUnavailable (before anything loads) and EngineStartFailed (the engine process failed)."""
    from engine.backends import measured_on

    sock = bind_port(options.host, options.port)
    try:
        say(f"loading {config.model.model_dir} ({config.backend}, {config.model.dtype}, cp {config.cp}, graph "
            f"{config.graph.mode}) ...")
        try:
            app = build_app(config, served_model_name=options.served_model_name, api_key=options.api_key,
                            engine_process=options.engine_process)
        except RuntimeError as e:  # from the engine process: what it could not do
            raise EngineStartFailed(f"cannot start the engine: {e}") from None
        listen(sock, options.host, options.port)
        host, port = sock.getsockname()[:2]
        url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
        say(f"serving {app.state.config.served_model_name} on {url} ({measured_on(config.backend)}); "
            f"SIGTERM / Ctrl-C drains for up to {options.drain_timeout_s:g} s")
        run_app(app, sock, drain_timeout_s=options.drain_timeout_s, log_level=options.log_level)
    finally:
        sock.close()
    if options.exit_when_done:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
