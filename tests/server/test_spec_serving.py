"""`/v1/completions` with speculative decoding: several tokens land in one engine step, and what a client sees -
streamed deltas, logprobs, n, stop tokens, max_tokens, usage - is exactly what the same requests give without it.

Two apps over the same fake model (tests/fake_runner.py: random logits after every prefix): plain, and with a draft
head that proposes the model's own greedy continuation with every third position wrong (`SpecFakeRunner`), so
accepted runs of every length occur."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from tests.server.fakes import SERVED, make_ids_app
from tests.server.test_completions import sse_events

PROMPTS = [[5, 17, 3, 88, 42, 9, 60], [1, 33, 71, 2, 14, 50, 8, 95, 23, 66, 4, 39, 12, 7, 7, 7, 7, 19, 20]]


@pytest.fixture(scope="module")
def clients() -> Iterator[tuple[TestClient, TestClient]]:
    with TestClient(make_ids_app()) as plain, TestClient(make_ids_app(num_speculative_tokens=3)) as spec:
        yield plain, spec


def _strip(body: dict) -> dict:
    return {k: v for k, v in body.items() if k not in ("id", "created")}


def _post(client: TestClient, **body: object) -> dict:
    r = client.post("/v1/completions", json={"model": SERVED, **body})
    assert r.status_code == 200, r.text
    return _strip(r.json())


BODIES = [
    {"prompt": PROMPTS[0], "max_tokens": 17, "temperature": 0, "logprobs": 2},
    {"prompt": PROMPTS, "max_tokens": 9, "temperature": 0, "n": 2, "logprobs": 1, "echo": True},
    {"prompt": PROMPTS[1], "max_tokens": 30, "temperature": 0},
]


@pytest.mark.parametrize("i", range(len(BODIES)))
def test_responses_equal_the_plain_engine(clients: tuple[TestClient, TestClient], i: int) -> None:
    plain, spec = clients
    assert _post(spec, **BODIES[i]) == _post(plain, **BODIES[i])


def test_stop_token_inside_an_accepted_run(clients: tuple[TestClient, TestClient]) -> None:
    """Stop on a token the plain run emits mid-way: both runs stop there, usage counts the same tokens."""
    plain, spec = clients
    full = _post(plain, prompt=PROMPTS[0], max_tokens=24, temperature=0, logprobs=0)
    toks = [int(t.split(":")[1]) for t in full["choices"][0]["logprobs"]["tokens"]]
    stop = toks[10]
    body = {"prompt": PROMPTS[0], "max_tokens": 24, "temperature": 0, "stop_token_ids": [stop], "logprobs": 0}
    a, b = _post(spec, **body), _post(plain, **body)
    assert a == b and a["choices"][0]["finish_reason"] == "stop"
    assert a["usage"]["completion_tokens"] == toks.index(stop) + 1


def _stream(client: TestClient, **body: object) -> list[dict]:
    r = client.post("/v1/completions", json={"model": SERVED, "stream": True, **body})
    assert r.status_code == 200, r.text
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_streamed_deltas_carry_several_tokens_and_add_up(clients: tuple[TestClient, TestClient]) -> None:
    plain, spec = clients
    body = {"prompt": PROMPTS[1], "max_tokens": 20, "temperature": 0, "logprobs": 1,
            "stream_options": {"include_usage": True}}
    chunks = {name: _stream(c, **body) for name, c in (("plain", plain), ("spec", spec))}

    def tokens(cs: list[dict]) -> list[str]:
        return [t for c in cs for ch in c["choices"] for t in (ch.get("logprobs") or {}).get("tokens", [])]

    def per_chunk(cs: list[dict]) -> list[int]:
        return [len((ch.get("logprobs") or {}).get("tokens", [])) for c in cs for ch in c["choices"]]

    assert tokens(chunks["spec"]) == tokens(chunks["plain"]) and len(tokens(chunks["plain"])) == 20
    assert max(per_chunk(chunks["plain"])) == 1 and max(per_chunk(chunks["spec"])) > 1  # several tokens per delta
    text = {n: "".join(ch["text"] for c in cs for ch in c["choices"]) for n, cs in chunks.items()}
    assert text["spec"] == text["plain"]
    usage = {n: cs[-1]["usage"] for n, cs in chunks.items()}
    assert usage["spec"] == usage["plain"] and usage["spec"]["completion_tokens"] == 20


def test_metrics_count_drafts(clients: tuple[TestClient, TestClient]) -> None:
    _, spec = clients
    _post(spec, prompt=PROMPTS[0], max_tokens=12, temperature=0)
    text = spec.get("/metrics").text
    vals = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith("vllm:spec_decode") and "position" not in line}
    drafted, accepted = (vals[f"vllm:spec_decode_num_{n}_tokens_total"] for n in ("draft", "accepted"))
    assert vals["vllm:spec_decode_num_drafts_total"] > 0 and 0 < accepted < drafted
