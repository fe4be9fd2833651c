"""`deepinfer serve` stopping: SIGTERM drains open requests for a bounded time, then ends the rest (a stream: an
error event and [DONE]; a non-streamed request: a 503), stops the engine and exits 0 with no traceback; a busy port
is one line and exit 2 before anything loads. Real processes on loopback: the fake engine behind
server/serve.py's `run_app` (tests/server/serve_fake.py), and the real tiny model behind `deepinfer serve`.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import REPO, free_port
from tests.server.fakes import SERVED

TINY = REPO / "golden" / "tiny"
# What a shutdown may take beyond the drain time: the open replies are ended at the drain time (their last events
# are written within ~0.1 s), the engine gets 1.5 s to stop before it is killed (deepinfer_bench/server/api.py
# ENGINE_STOP_S), the process then ends at once; +1.5 s for scheduling on a shared 2-core CI box.
EXIT_MARGIN_S = 3.0


@dataclass
class Served:
    proc: subprocess.Popen[str]
    base: str
    log: list[str] = field(default_factory=list)  # stdout + stderr lines of the server

    def log_text(self) -> str:
        return "\n".join(self.log)

    def stop_and_wait(self, timeout_s: float) -> tuple[int, float]:
        """SIGTERM; (exit code, seconds until the process ended)."""
        t0 = time.monotonic()
        self.proc.send_signal(signal.SIGTERM)
        rc = self.proc.wait(timeout=timeout_s)
        return rc, time.monotonic() - t0


def _start(args: list[str], port: int | None, timeout_s: float) -> Served:
    """Start a server process; with `port` None the first stdout line is its port. Returns once /health is 200."""
    proc = subprocess.Popen([sys.executable, *args], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.stdout is not None
    if port is None:
        first = proc.stdout.readline()
        assert first.strip().isdigit(), first
        port = int(first)
    served = Served(proc, f"http://127.0.0.1:{port}")
    threading.Thread(target=lambda: served.log.extend(line.rstrip() for line in proc.stdout), daemon=True).start()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{served.log_text()[-3000:]}")
        try:
            if httpx.get(f"{served.base}/health", timeout=1.0).status_code == 200:
                return served
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"server not healthy within {timeout_s}s:\n{served.log_text()[-3000:]}")


def serve_fake(factory: str, drain_s: float, **kwargs: object) -> Served:
    return _start(["-m", "tests.server.serve_fake", factory, str(drain_s), json.dumps(kwargs)], None, 60)


def descendants(pid: int) -> set[int]:
    """Processes below `pid` (from /proc)."""
    parent: dict[int, int] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            parent[int(d.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    out, todo = set(), [pid]
    while todo:
        p = todo.pop()
        kids = {c for c, pp in parent.items() if pp == p}
        out |= kids
        todo += kids
    return out


def running(pid: int) -> bool:
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def outlived(pids: set[int], wait_s: float = 2.0) -> set[int]:
    """The processes of `pids` still running `wait_s` after the server ended (multiprocessing's resource tracker
    ends when it reads the end of its pipe, a moment after the server)."""
    deadline = time.monotonic() + wait_s
    while (alive := {p for p in pids if running(p)}) and time.monotonic() < deadline:
        time.sleep(0.05)
    return alive


@dataclass
class StreamSeen:
    token_chunks: int = 0
    finish_reason: str | None = None
    error: dict | None = None
    done: bool = False
    after_done: int = 0  # events after [DONE] (must be none)
    failure: str | None = None  # the client's exception (e.g. an incomplete chunked read)

    @property
    def ended_properly(self) -> bool:
        """A normal completion, or an error event; either way followed by [DONE] and nothing else."""
        normal = self.finish_reason is not None and self.error is None
        cut = self.error is not None and self.finish_reason is None
        return self.failure is None and self.done and self.after_done == 0 and (normal or cut)


async def read_stream(client: httpx.AsyncClient, url: str, body: dict, first: asyncio.Event | None = None,
                      ) -> StreamSeen:
    seen = StreamSeen()
    try:
        async with client.stream("POST", url, json=body) as r:
            assert r.status_code == 200, await r.aread()
            async for line in r.aiter_lines():
                if not line:
                    continue
                assert line.startswith("data: "), line
                payload = line[len("data: "):]
                if seen.done:
                    seen.after_done += 1
                elif payload == "[DONE]":
                    seen.done = True
                else:
                    event = json.loads(payload)
                    if "error" in event:
                        seen.error = event["error"]
                    elif event["choices"]:
                        seen.token_chunks += 1
                        seen.finish_reason = event["choices"][0]["finish_reason"] or seen.finish_reason
                        if first is not None:
                            first.set()
    except httpx.HTTPError as e:
        seen.failure = f"{type(e).__name__}: {e}"
    return seen


async def engine_holds(client: httpx.AsyncClient, base: str, n: int) -> None:
    """Return once the server's engine holds n requests (running + waiting, from GET /metrics)."""
    names = ("deepinfer:num_requests_running", "deepinfer:num_requests_waiting")
    while True:
        text = (await client.get(f"{base}/metrics")).text
        if sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(names)) >= n:
            return
        await asyncio.sleep(0.02)


def completion(prompt: list[int], max_tokens: int, stream: bool) -> dict:
    return {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0, "stream": stream}


def test_drain_lets_open_requests_finish() -> None:
    """A drain time longer than the open requests: they all complete normally; the listener closes at once; the
    process exits as soon as they are done (not after the whole drain), with 0. Ctrl-C's SIGINT here (the other
    tests send SIGTERM): both drain."""
    srv = serve_fake("make_fake_app", 30.0, step_delay_s=0.03, num_kv_blocks=64)
    url = f"{srv.base}/v1/completions"

    async def go() -> tuple[list[StreamSeen], httpx.Response, float, int, float]:
        async with httpx.AsyncClient(timeout=30) as c:
            firsts = [asyncio.Event() for _ in range(2)]
            streams = [asyncio.create_task(read_stream(c, url, completion([1, 2, 3 + i], 40, True), firsts[i]))
                       for i in range(2)]
            whole = asyncio.create_task(c.post(url, json=completion([9, 8, 7], 40, False)))
            await asyncio.wait_for(asyncio.gather(*(f.wait() for f in firsts)), 30)
            # the non-streamed request inside the engine too before the signal (a request the server has not read
            # yet is refused by the drain, as it should be: on a loaded box it once was still in flight)
            await asyncio.wait_for(engine_holds(c, srv.base, 3), 30)
            t0 = time.monotonic()
            srv.proc.send_signal(signal.SIGINT)
            refused_after = None
            while refused_after is None and time.monotonic() - t0 < 5:  # new connections are refused
                try:
                    async with httpx.AsyncClient(timeout=1) as fresh:
                        await fresh.get(f"{srv.base}/health")
                except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError):
                    # refused, or (a loaded box) accepted into the listener's backlog just before it closed and
                    # then dropped without a response: either way not served
                    refused_after = time.monotonic() - t0
                await asyncio.sleep(0.05)
            seen = list(await asyncio.gather(*streams))
            resp = await whole
            rc = await asyncio.to_thread(srv.proc.wait, 30)
            return seen, resp, refused_after, rc, time.monotonic() - t0

    try:
        seen, resp, refused_after, rc, exit_s = asyncio.run(go())
    finally:
        srv.proc.kill()
    for s in seen:
        assert s.ended_properly and s.error is None and s.finish_reason == "length" and s.token_chunks == 40, s
    assert resp.status_code == 200 and resp.json()["choices"][0]["finish_reason"] == "length"
    assert resp.json()["usage"]["completion_tokens"] == 40
    assert refused_after is not None and refused_after < 2.0
    assert rc == 0 and exit_s < 15, (rc, exit_s)  # done when the requests are (~1.2 s of steps), not at 30 s
    assert "Traceback" not in srv.log_text(), srv.log_text()


def test_drain_timeout_ends_streams_with_an_error_event_and_others_with_503() -> None:
    """Requests that outlast the drain: each stream gets an error event then [DONE], each non-streamed request a
    503 with an OpenAI error body; the engine process stops; exit 0 within drain + margin; no traceback."""
    drain_s = 1.0
    srv = serve_fake("make_slow_process_app", drain_s, step_delay_s=0.05)  # 200 tokens: ~10 s
    url = f"{srv.base}/v1/completions"
    engine_pids = descendants(srv.proc.pid)
    assert engine_pids and all(running(p) for p in engine_pids)

    async def go() -> tuple[list[StreamSeen], list[httpx.Response], int, float]:
        async with httpx.AsyncClient(timeout=30) as c:
            firsts = [asyncio.Event() for _ in range(2)]
            streams = [asyncio.create_task(read_stream(c, url, completion([1, 2, 3 + i], 200, True), firsts[i]))
                       for i in range(2)]
            wholes = [asyncio.create_task(c.post(url, json=completion([9, 8, 7 + i], 200, False))) for i in range(2)]
            await asyncio.wait_for(asyncio.gather(*(f.wait() for f in firsts)), 30)
            four = f'deepinfer:num_requests_running{{model_name="{SERVED}"}} 4'
            deadline = time.monotonic() + 30
            while four not in (await c.get(f"{srv.base}/metrics")).text:  # all four running in the engine
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
            rc, exit_s = await asyncio.to_thread(srv.stop_and_wait, 30)
            return list(await asyncio.gather(*streams)), list(await asyncio.gather(*wholes)), rc, exit_s

    try:
        seen, resps, rc, exit_s = asyncio.run(go())
    finally:
        srv.proc.kill()
    for s in seen:
        assert s.ended_properly and s.error is not None and s.token_chunks >= 1, s
        assert "shutting down" in s.error["message"] and s.error["code"] == "server_shutting_down"
    for r in resps:
        assert r.status_code == 503, r.text
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["code"] == "server_shutting_down"
    assert rc == 0 and exit_s < drain_s + EXIT_MARGIN_S, (rc, exit_s)
    assert not outlived(engine_pids), "the engine process outlived the server"
    log = srv.log_text()
    assert "Traceback" not in log and "Ended 4 request(s)" in log, log


def test_busy_port_is_one_line_and_exit_2_before_loading() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        t0 = time.monotonic()
        r = subprocess.run([sys.executable, "-m", "deepinfer_bench.cli", "serve", "--port", str(port),
                            "--model-dir", str(TINY), "--backend", "host"], cwd=REPO, capture_output=True, text=True,
                           env={**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "200"}, timeout=120)
        took = time.monotonic() - t0
    lines = [line for line in (r.stdout + r.stderr).splitlines() if line.strip()]
    assert r.returncode == 2 and len(lines) == 1, (r.returncode, lines)
    assert f"port {port}" in lines[0] and "in use" in lines[0] and lines[0].startswith("error:"), lines
    assert "loading" not in r.stderr and took < 60  # nothing was loaded (the import alone takes a few seconds)
    r = subprocess.run([sys.executable, "-m", "deepinfer_bench.cli", "serve", "--host", "192.0.2.1", "--port", "0",
                        "--backend", "host"], cwd=REPO, capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "200"}, timeout=120)
    lines = [line for line in (r.stdout + r.stderr).splitlines() if line.strip()]
    assert r.returncode == 2 and len(lines) == 1 and "192.0.2.1" in lines[0], lines  # not a local address


def _sigterm_with_streams_open(num_streams: int, extra_args: list[str]) -> None:
    """`deepinfer serve` on the real tiny model, `num_streams` long streams open, SIGTERM: every client sees a normal
    end or an error event, then [DONE]; exit 0 within drain + margin; no process it started is left; no
    traceback in the log."""
    drain_s = 1.0
    port = free_port()
    srv = _start(["-m", "deepinfer_bench.cli", "serve", "--model-dir", str(TINY), "--backend", "host",
                  "--max-num-seqs", "16", "--max-model-len", "2048", "--port", str(port), "--drain-timeout",
                  str(drain_s), *extra_args], port, 300)
    url = f"{srv.base}/v1/completions"
    started = descendants(srv.proc.pid)  # the engine process (and its rank processes), multiprocessing's tracker
    assert started

    async def go() -> tuple[list[StreamSeen], int, float]:
        async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=16)) as c:
            firsts = [asyncio.Event() for _ in range(num_streams)]
            streams = [asyncio.create_task(read_stream(c, url, completion([5, 6, 7, 10 + i], 1500, True), firsts[i]))
                       for i in range(num_streams)]
            await asyncio.wait_for(asyncio.gather(*(f.wait() for f in firsts)), 300)
            rc, exit_s = await asyncio.to_thread(srv.stop_and_wait, 60)
            return list(await asyncio.gather(*streams)), rc, exit_s

    try:
        seen, rc, exit_s = asyncio.run(go())
    finally:
        srv.proc.kill()
    for s in seen:
        assert s.ended_properly and s.token_chunks >= 1, s
    assert any(s.error is not None for s in seen)  # 1500 tokens cannot finish within 1 s: the drain cut them
    assert rc == 0 and exit_s < drain_s + EXIT_MARGIN_S, (rc, exit_s, srv.log_text()[-2000:])
    assert not outlived(started), "a process the server started outlived it"
    assert "Traceback" not in srv.log_text(), srv.log_text()


@pytest.mark.skipif(not (TINY / "config.json").exists(), reason="golden/tiny not generated")
def test_sigterm_with_8_streams_on_the_tiny_model() -> None:
    _sigterm_with_streams_open(8, ["--num-kv-blocks", "256", "--block-size", "16"])


@pytest.mark.slow
@pytest.mark.skipif(not (TINY / "config.json").exists(), reason="golden/tiny not generated")
def test_sigterm_with_streams_on_two_ranks() -> None:
    """The same with the engine on cp = 2 rank processes (below the engine process): they stop too."""
    _sigterm_with_streams_open(4, ["--cp", "2", "--num-kv-blocks", "128", "--block-size", "32"])
