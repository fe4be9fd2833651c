"""`/v1/completions` with prefix caching (the real engine over tests/fake_runner.py's model, whose logits hash every
token before them): requests sharing a prompt prefix return exactly what they return without the cache, and
`/metrics` counts the prompt tokens looked up and found under vLLM's names."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from tests.server.fakes import SERVED, make_ids_app

SYSTEM = [(7 * i + 3) % 90 + 2 for i in range(37)]  # a shared "system prompt": 4 blocks of 8 and 5 tokens


@pytest.fixture(scope="module")
def clients() -> Iterator[tuple[TestClient, TestClient]]:
    with TestClient(make_ids_app()) as plain, TestClient(make_ids_app(enable_prefix_caching=True)) as cached:
        yield plain, cached


def _post(client: TestClient, **body: object) -> dict:
    r = client.post("/v1/completions", json={"model": SERVED, **body})
    assert r.status_code == 200, r.text
    return {k: v for k, v in r.json().items() if k not in ("id", "created")}


def _counters(client: TestClient) -> dict[str, float]:
    return {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in client.get("/metrics").text.splitlines()
            if line.startswith("vllm:prefix_cache")}


def test_shared_prefix_hits_and_answers_unchanged(clients: tuple[TestClient, TestClient]) -> None:
    plain, cached = clients
    assert _counters(cached) == {"vllm:prefix_cache_queries_total": 0, "vllm:prefix_cache_hits_total": 0}
    bodies = [{"prompt": SYSTEM + suffix, "max_tokens": 12, "temperature": 0, "logprobs": 1}
              for suffix in ([40, 41, 42], [50, 51], [60, 61, 62, 63])]
    for body in bodies:
        assert _post(cached, **body) == _post(plain, **body)
    got = _counters(cached)
    assert got["vllm:prefix_cache_queries_total"] == sum(len(b["prompt"]) for b in bodies)
    assert got["vllm:prefix_cache_hits_total"] == 2 * 32  # the second and third: the system prompt's 4 full blocks
    assert _counters(plain) == {"vllm:prefix_cache_queries_total": 0, "vllm:prefix_cache_hits_total": 0}
