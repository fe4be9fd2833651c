from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from tests.server.fakes import make_fake_app

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def client() -> Iterator[TestClient]:
    with TestClient(make_fake_app()) as c:
        yield c


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args: list[str], *, timeout_s: float = 120.0,
                 env: dict[str, str] | None = None) -> tuple[subprocess.Popen[bytes], str]:
    """Start a server process on a free loopback port (`env`: added to this process's environment); return it once
    /health answers 200. `timeout_s` catches a start that hangs; it is not a speed check (CI runs its lanes side by
    side on 2 cores, where a start can take several times its time on an idle machine)."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, *args, "--host", "127.0.0.1", "--port", str(port)], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env={**os.environ, **(env or {})})
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}: {proc.stderr.read().decode()[-2000:]}")
        try:
            if httpx.get(f"{base}/health", timeout=1.0).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    stop_server(proc)
    raise RuntimeError(f"server did not become healthy within {timeout_s}s")


def stop_server(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=5)


def _serve(factory: str) -> Iterator[str]:
    proc, base = start_server(["-m", "uvicorn", "--factory", f"tests.server.fakes:{factory}", "--log-level", "warning"])
    try:
        yield base
    finally:
        stop_server(proc)


@pytest.fixture(scope="session")
def live_server() -> Iterator[str]:
    """uvicorn in its own process over the fake engine (5 ms per step) on 127.0.0.1:<free port>, engine on a thread."""
    yield from _serve("make_slow_app")


@pytest.fixture(scope="session")
def live_process_server() -> Iterator[str]:
    """The same with the engine loop in a child process of the server (ProcessEngineLoop)."""
    yield from _serve("make_slow_process_app")


@pytest.fixture(params=["thread", "process"])
def any_server(request: pytest.FixtureRequest) -> str:
    return request.getfixturevalue("live_server" if request.param == "thread" else "live_process_server")
