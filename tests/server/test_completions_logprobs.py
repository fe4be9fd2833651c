"""`/v1/completions` logprobs, echo, n and best_of over the real engine with a fake model whose logits after any prefix
are known (tests/fake_runner.py `FakeRunner`: random logits from a hash of the prefix), token ids only."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
import torch
from fastapi.testclient import TestClient

from tests.server.fakes import SERVED, make_ids_app
from tests.server.test_completions import assert_error, sse_events

PROMPT = [5, 17, 3, 88, 42, 9, 60, 1, 33, 71, 2, 14, 50, 8, 95, 23, 66, 4, 39, 12]  # 20 tokens, chunked at 16


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    with TestClient(make_ids_app()) as c:
        yield c


def post(client: TestClient, **body: object) -> dict:
    r = client.post("/v1/completions", json={"model": SERVED, "prompt": PROMPT, **body})
    assert r.status_code == 200, r.text
    return r.json()


def ref_lp(client: TestClient, prefix: list[int]) -> torch.Tensor:
    """log-softmax of the fake model's logits after `prefix`, computed without the engine."""
    runner = client.app.state.engine_loop.engine.runner
    return torch.log_softmax(runner.logits_for_hash(runner.prefix_hash(prefix)), -1)


def tok(t: int) -> str:
    return f"token_id:{t}"


def check_position(client: TestClient, lp: dict, i: int, prefix: list[int], token: int, k: int) -> None:
    ref = ref_lp(client, prefix)
    assert lp["tokens"][i] == tok(token)
    assert lp["token_logprobs"][i] == pytest.approx(float(ref[token]), abs=1e-5)
    want = {tok(token): float(ref[token]), **{tok(t): float(ref[t]) for t in ref.topk(k).indices.tolist()}}
    assert lp["top_logprobs"][i] == pytest.approx(want, abs=1e-5)


def stream(client: TestClient, **body: object) -> list[dict]:
    r = client.post("/v1/completions", json={"model": SERVED, "prompt": PROMPT, "stream": True, **body})
    assert r.status_code == 200, r.text
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_echo_max_tokens_0_is_the_prompt_with_its_logprobs(client: TestClient) -> None:
    """What lm-eval's loglikelihood and `openai.completions.create(echo=True, logprobs=3, max_tokens=0)` ask."""
    body = post(client, echo=True, logprobs=3, max_tokens=0, temperature=0)
    (c,) = body["choices"]
    lp = c["logprobs"]
    assert c["finish_reason"] == "length" and c["text"] == ""
    assert body["usage"] == {"prompt_tokens": 20, "completion_tokens": 0, "total_tokens": 20}
    assert lp["tokens"] == [tok(t) for t in PROMPT]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    for i in range(1, len(PROMPT)):
        check_position(client, lp, i, PROMPT[:i], PROMPT[i], 3)
    lens = [len(t) for t in lp["tokens"]]
    assert lp["text_offset"] == [sum(lens[:i]) for i in range(len(lens))]


def test_generated_logprobs_and_echo_with_generation(client: TestClient) -> None:
    plain = post(client, logprobs=2, max_tokens=5, temperature=0, ignore_eos=True)["choices"][0]["logprobs"]
    echo = post(client, echo=True, logprobs=2, max_tokens=5, temperature=0, ignore_eos=True)["choices"][0]
    out = [int(t.split(":")[1]) for t in plain["tokens"]]
    assert len(out) == 5
    for j, t in enumerate(out):
        assert ref_lp(client, PROMPT + out[:j]).argmax() == t  # greedy
        check_position(client, plain, j, PROMPT + out[:j], t, 2)
    lp = echo["logprobs"]
    assert lp["tokens"] == [tok(t) for t in PROMPT + out]
    assert lp["token_logprobs"][20:] == plain["token_logprobs"] and lp["top_logprobs"][20:] == plain["top_logprobs"]
    check_position(client, lp, 7, PROMPT[:7], PROMPT[7], 2)
    # lm-eval's request (echo, logprobs=1, max_tokens=1): the prompt's logprobs are the first len(prompt) entries
    lm = post(client, echo=True, logprobs=1, max_tokens=1, temperature=0)["choices"][0]["logprobs"]
    assert len(lm["tokens"]) == 21 and lm["token_logprobs"][:20] == pytest.approx(
        post(client, echo=True, logprobs=1, max_tokens=0)["choices"][0]["logprobs"]["token_logprobs"])


def test_streamed_logprobs_equal_the_non_streamed(client: TestClient) -> None:
    for extra in ({"echo": True, "max_tokens": 6}, {"max_tokens": 6}, {"echo": True, "max_tokens": 0}):
        body = {"logprobs": 2, "temperature": 0, "ignore_eos": True, **extra}
        whole = post(client, **body)["choices"][0]["logprobs"]
        chunks = [c["choices"][0] for c in stream(client, **body) if c["choices"]]
        assert len(chunks) == max(1, extra["max_tokens"])  # one chunk per token; the prompt rides on the first
        joined = {k: [x for c in chunks for x in c["logprobs"][k]] for k in whole}
        assert joined == whole


def test_prompt_logprobs_field_vllm_layout(client: TestClient) -> None:
    (c,) = post(client, prompt_logprobs=2, max_tokens=1, temperature=0)["choices"]
    plp = c["prompt_logprobs"]
    assert len(plp) == 20 and plp[0] is None and c["logprobs"] is None
    ref = ref_lp(client, PROMPT[:5])
    entry = plp[5]
    assert entry[str(PROMPT[5])]["logprob"] == pytest.approx(float(ref[PROMPT[5]]), abs=1e-5)
    assert entry[str(PROMPT[5])]["rank"] == int((ref > ref[PROMPT[5]]).sum()) + 1
    top = ref.topk(2).indices.tolist()
    assert [entry[str(t)]["rank"] for t in top] == [1, 2] and entry[str(top[0])]["decoded_token"] == tok(top[0])
    assert all(len(e) <= 3 for e in plp[1:])  # the token and the top 2
    # prompt_logprobs=1 next to echo with logprobs=3: each field keeps its own k
    (c,) = post(client, prompt_logprobs=1, echo=True, logprobs=3, max_tokens=1, temperature=0)["choices"]
    assert all(len(e) <= 2 for e in c["prompt_logprobs"][1:]) and len(c["logprobs"]["top_logprobs"][5]) >= 3


def test_n_samples_are_independent_with_seed_plus_index(client: TestClient) -> None:
    body = {"max_tokens": 6, "temperature": 1.0, "ignore_eos": True, "seed": 11, "return_token_ids": True}
    n3 = post(client, n=3, **body)
    singles = [post(client, **{**body, "seed": 11 + j})["choices"][0]["token_ids"] for j in range(3)]
    assert [c["index"] for c in n3["choices"]] == [0, 1, 2]
    assert [c["token_ids"] for c in n3["choices"]] == singles
    assert len({tuple(s) for s in singles}) > 1  # different seeds, different samples
    assert n3["usage"] == {"prompt_tokens": 20, "completion_tokens": 18, "total_tokens": 38}
    two = client.post("/v1/completions", json={"prompt": [PROMPT, PROMPT[:4]], "n": 2, **body}).json()
    assert [c["index"] for c in two["choices"]] == [0, 1, 2, 3]
    assert [c["token_ids"] for c in two["choices"][:2]] == singles[:2]
    assert two["usage"]["prompt_tokens"] == 24
    chunks = stream(client, n=3, stream_options={"include_usage": True}, **body)
    per = {j: [t for c in chunks if c["choices"] and c["choices"][0]["index"] == j
               for t in c["choices"][0]["token_ids"]] for j in range(3)}
    assert list(per.values()) == singles and chunks[-1]["usage"]["completion_tokens"] == 18


def test_best_of_returns_the_best_by_mean_logprob(client: TestClient) -> None:
    body = {"max_tokens": 5, "temperature": 1.5, "ignore_eos": True, "seed": 3, "return_token_ids": True}
    cands = [post(client, **{**body, "seed": 3 + j}, logprobs=0)["choices"][0] for j in range(4)]
    means = [sum(c["logprobs"]["token_logprobs"]) / 5 for c in cands]
    order = sorted(range(4), key=lambda j: -means[j])
    got = post(client, best_of=4, n=2, **body)
    assert [c["token_ids"] for c in got["choices"]] == [cands[j]["token_ids"] for j in order[:2]]
    assert got["choices"][0]["logprobs"] is None  # not asked: used for the ranking only
    assert got["usage"]["completion_tokens"] == 10


@pytest.mark.parametrize(("body", "param", "contains"), [
    ({"logprobs": 21}, "logprobs", "max_logprobs"), ({"n": 0}, "n", "at least 1"),
    ({"prompt_logprobs": 2, "stream": True}, "prompt_logprobs", "stream"),
    ({"best_of": 2, "stream": True}, "best_of", "stream"), ({"max_tokens": 0}, "max_tokens", "echo"),
    ({"prompt": [5, 97]}, "prompt", "out of range"),
])
def test_bad_new_fields_are_400_and_the_server_stays_healthy(client: TestClient, body: dict, param: str,
                                                             contains: str) -> None:
    assert_error(client.post("/v1/completions", json={"prompt": PROMPT, **body}), 400, contains=contains, param=param)
    assert client.get("/health").status_code == 200
    assert post(client, max_tokens=1)["usage"]["completion_tokens"] == 1
