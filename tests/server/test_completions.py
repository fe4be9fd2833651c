"""`/v1/completions` and friends through FastAPI's TestClient over the fake engine (fast, in-process)."""

from __future__ import annotations

import json
import time

import pytest
from fastapi.testclient import TestClient

from tests.server.fakes import BOS, EOS, SERVED, ByteTokenizer, make_fake_app, offline_greedy

TOK = ByteTokenizer()


def completion(client: TestClient, **body: object):
    return client.post("/v1/completions", json={"model": SERVED, **body})


def sse_events(raw: str) -> list[str]:
    """Split an SSE body strictly: every event is exactly `data: <payload>` followed by a blank line."""
    assert raw.endswith("\n\n")
    events = raw[:-2].split("\n\n")
    for e in events:
        assert e.startswith("data: ") and "\n" not in e, repr(e)
    return [e[len("data: "):] for e in events]


def assert_error(resp, status: int, *, contains: str = "", param: str | None = None) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert contains.lower() in err["message"].lower()
    if param is not None:
        assert err["param"] == param
    return err


def test_models_health(client: TestClient) -> None:
    assert client.get("/health").status_code == 200
    card = client.get("/v1/models").json()["data"][0]
    assert card["id"] == SERVED and card["object"] == "model" and card["max_model_len"] == 256
    assert card["root"].endswith("tests/server")


def test_text_prompt_non_stream(client: TestClient) -> None:
    r = completion(client, prompt="Hello", max_tokens=12, temperature=0, ignore_eos=True)
    assert r.status_code == 200, r.text
    body = r.json()
    ids = TOK.encode("Hello")
    want = offline_greedy(ids, 12, ignore_eos=True)
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-") and body["model"] == SERVED
    (choice,) = body["choices"]
    assert choice["index"] == 0 and choice["finish_reason"] == "length" and choice["logprobs"] is None
    assert choice["text"] == TOK.decode(want)
    assert body["usage"] == {"prompt_tokens": len(ids), "completion_tokens": 12, "total_tokens": len(ids) + 12}


def test_token_id_prompt_and_list_of_prompts(client: TestClient) -> None:
    prompts = [[BOS, 70, 80, 90], [BOS, 100], [BOS, 5, 6, 7, 8, 9]]
    r = completion(client, prompt=prompts, max_tokens=8, ignore_eos=True, temperature=0)
    body = r.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    for p, c in zip(prompts, body["choices"], strict=True):
        assert c["text"] == TOK.decode(offline_greedy(p, 8, ignore_eos=True))
    assert body["usage"]["prompt_tokens"] == 4 + 2 + 6 and body["usage"]["completion_tokens"] == 24
    r = completion(client, prompt=["ab", "cd"], max_tokens=3, ignore_eos=True)
    assert [c["text"] for c in r.json()["choices"]] == [
        TOK.decode(offline_greedy(TOK.encode(t), 3, ignore_eos=True)) for t in ("ab", "cd")]


@pytest.mark.parametrize("include_usage", [True, False])
def test_stream_framing(client: TestClient, include_usage: bool) -> None:
    body = {"prompt": "Stream me", "max_tokens": 20, "ignore_eos": True, "stream": True}
    if include_usage:
        body["stream_options"] = {"include_usage": True}
    with client.stream("POST", "/v1/completions", json={"model": SERVED, **body}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = "".join(r.iter_text())
    events = sse_events(raw)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    token_chunks = [c for c in chunks if c["choices"]]
    assert len(token_chunks) == 20  # one chunk per generated token, none before the first token
    assert all(c["choices"][0]["finish_reason"] is None for c in token_chunks[:-1])
    assert token_chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert all("usage" not in c or c["usage"] is None for c in token_chunks)
    text = "".join(c["choices"][0]["text"] for c in token_chunks)
    assert text == TOK.decode(offline_greedy(TOK.encode("Stream me"), 20, ignore_eos=True))
    if include_usage:
        last = chunks[-1]
        assert last["choices"] == [] and last["usage"]["completion_tokens"] == 20
        assert last["usage"]["prompt_tokens"] == len(TOK.encode("Stream me"))
        assert len(chunks) == 21
    else:
        assert len(chunks) == 20


def test_multibyte_characters_never_split() -> None:
    # Find a prompt whose greedy output contains "é" (two tokens) and check every chunk is valid text.
    with TestClient(make_fake_app()) as client:
        for k in range(200):
            prompt = f"p{k}"
            want = TOK.decode(offline_greedy(TOK.encode(prompt), 40, ignore_eos=True))
            if "é" in want:
                break
        else:
            pytest.fail("the fake engine produced no two-byte character in 200 prompts")
        r = completion(client, prompt=prompt, max_tokens=40, ignore_eos=True, stream=True)
        chunks = [json.loads(e) for e in sse_events(r.text)[:-1]]
        assert len(chunks) == 40
        texts = [c["choices"][0]["text"] for c in chunks]
        assert "".join(texts) == want and not any("\ufffd" in t for t in texts)


def test_return_token_ids(client: TestClient) -> None:
    want = offline_greedy(TOK.encode("ids"), 6, ignore_eos=True)
    r = completion(client, prompt="ids", max_tokens=6, ignore_eos=True, return_token_ids=True).json()
    assert r["choices"][0]["token_ids"] == want
    r = completion(client, prompt="ids", max_tokens=6, ignore_eos=True, return_token_ids=True, stream=True)
    chunks = [json.loads(e) for e in sse_events(r.text)[:-1]]
    assert [c["choices"][0]["token_ids"] for c in chunks] == [[t] for t in want]
    assert "token_ids" not in completion(client, prompt="ids", max_tokens=2).json()["choices"][0]


def test_continuous_usage_stats(client: TestClient) -> None:
    r = completion(client, prompt="u", max_tokens=5, ignore_eos=True, stream=True,
                   stream_options={"include_usage": True, "continuous_usage_stats": True})
    chunks = [json.loads(e) for e in sse_events(r.text)[:-1]]
    assert [c["usage"]["completion_tokens"] for c in chunks] == [1, 2, 3, 4, 5, 5]
    assert chunks[-1]["choices"] == []


def test_engine_rejection_in_a_batch_aborts_the_others() -> None:
    # The engine's own rejection: the second prompt + max_tokens needs 13 blocks of a pool of 8 (it fits max_model_len).
    with TestClient(make_fake_app(num_kv_blocks=8)) as c:
        r = c.post("/v1/completions", json={"prompt": [[BOS, 50, 51], [BOS] + [4] * 150], "max_tokens": 50})
        assert_error(r, 400, contains="more than the whole pool", param="prompt")
        eng = c.app.state.engine_loop.engine
        for _ in range(100):
            if not eng.has_unfinished():
                break
            time.sleep(0.01)
        assert not eng.has_unfinished() and eng.stats().num_used_blocks == 0


def test_stop_strings_and_stop_token_ids(client: TestClient) -> None:
    full = completion(client, prompt="Hello", max_tokens=30, ignore_eos=True).json()["choices"][0]["text"]
    stop = full[10:12]
    cut = full.find(stop)
    for stream in (False, True):
        r = completion(client, prompt="Hello", max_tokens=30, ignore_eos=True, stop=[stop, "zzzz"], stream=stream)
        if stream:
            chunks = [json.loads(e) for e in sse_events(r.text)[:-1]]
            text = "".join(c["choices"][0]["text"] for c in chunks)
            reason = chunks[-1]["choices"][0]["finish_reason"]
        else:
            text, reason = r.json()["choices"][0]["text"], r.json()["choices"][0]["finish_reason"]
        assert text == full[:cut] and reason == "stop"
    ids = offline_greedy(TOK.encode("Hello"), 30, ignore_eos=True)
    r = completion(client, prompt="Hello", max_tokens=30, ignore_eos=True, stop_token_ids=[ids[5]])
    c = r.json()
    assert c["choices"][0]["finish_reason"] == "stop"
    assert c["usage"]["completion_tokens"] == ids.index(ids[5]) + 1


def stream_and_plain(client: TestClient, **body: object) -> tuple[list[dict], dict]:
    """The token chunks of a streamed completion and the choice + usage of the same request not streamed."""
    r = completion(client, stream=True, stream_options={"include_usage": True}, **body)
    chunks = [json.loads(e) for e in sse_events(r.text)[:-1]]
    assert chunks[-1]["choices"] == []
    plain = completion(client, **body).json()
    assert plain["usage"] == chunks[-1]["usage"]
    return [c for c in chunks if c["choices"]], plain


def test_stop_reason_and_text_are_the_engines_in_both_modes(client: TestClient) -> None:
    """vLLM's `stop_reason`: the stop string or stop token id that finished the choice, else null; the stop
    token is not text; streamed and non-streamed text agree; one chunk per generated token."""
    ids = TOK.encode("Hello")
    out = offline_greedy(ids, 30, ignore_eos=True)
    full = TOK.decode(out)
    stop = full[10:12]
    cases = [({"stop": stop}, "stop", stop, full[:full.find(stop)]),
             ({"stop_token_ids": [out[5]]}, "stop", out[5], TOK.decode(out[:out.index(out[5])])),
             ({}, "length", None, full)]
    for extra, reason, stop_reason, text in cases:
        chunks, plain = stream_and_plain(client, prompt="Hello", max_tokens=30, ignore_eos=True, **extra)
        choice = plain["choices"][0]
        assert (choice["text"], choice["finish_reason"], choice["stop_reason"]) == (text, reason, stop_reason)
        assert "".join(c["choices"][0]["text"] for c in chunks) == text
        assert [c["choices"][0]["stop_reason"] for c in chunks] == [None] * (len(chunks) - 1) + [stop_reason]
        assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + [reason]
        assert len(chunks) == plain["usage"]["completion_tokens"]


def test_min_tokens_defers_stops(client: TestClient) -> None:
    ids = TOK.encode("Hello")
    full = TOK.decode(offline_greedy(ids, 30, ignore_eos=True))
    assert len(full) == 30  # one character per token in this output
    c = next(ch for ch in full if full.count(ch) >= 2 and full.index(ch) > 0)
    first, later = full.index(c), full.index(c, full.index(c) + 1)
    chunks, plain = stream_and_plain(client, prompt="Hello", max_tokens=30, ignore_eos=True, stop=[c],
                                     min_tokens=first + 2)
    assert plain["choices"][0]["text"] == full[:later] == "".join(ch["choices"][0]["text"] for ch in chunks)
    assert plain["usage"]["completion_tokens"] == later + 1 == len(chunks)
    assert_error(completion(client, prompt="Hello", max_tokens=3, min_tokens=4), 400, param="min_tokens")
    assert_error(completion(client, prompt="Hello", max_tokens=3, min_tokens=-1), 400, param="min_tokens")


def test_eos_stops_unless_ignored(client: TestClient) -> None:
    for k in range(300):
        ids = TOK.encode(f"q{k}")
        if EOS in offline_greedy(ids, 30, ignore_eos=True)[:-1]:
            break
    n = offline_greedy(ids, 30).index(EOS) + 1
    r = completion(client, prompt=ids, max_tokens=30).json()
    assert r["choices"][0]["finish_reason"] == "stop" and r["usage"]["completion_tokens"] == n
    r = completion(client, prompt=ids, max_tokens=30, ignore_eos=True).json()
    assert r["choices"][0]["finish_reason"] == "length" and r["usage"]["completion_tokens"] == 30


def test_max_tokens_clamped_to_context(client: TestClient) -> None:
    ids = [BOS] + [50] * 249  # 250 of max_model_len 256
    r = completion(client, prompt=ids, max_tokens=16, ignore_eos=True).json()
    assert r["usage"]["completion_tokens"] == 6 and r["choices"][0]["finish_reason"] == "length"
    r = completion(client, prompt=[BOS, 50], ignore_eos=True).json()  # default max_tokens = 16
    assert r["usage"]["completion_tokens"] == 16


def test_legacy_and_unknown_fields_accepted(client: TestClient) -> None:
    r = completion(client, prompt="x", max_tokens=2, best_of=1, repetition_penalty=1.0, user="u", logprobs=None,
                   min_p=0.0, top_k=-1, n=1, echo=False, frequency_penalty=0, presence_penalty=0.0, something_new=1,
                   stream_options=None, temperature=0.7, top_p=0.9, seed=3)
    assert r.status_code == 200, r.text


def test_sampling_seed_reproducible(client: TestClient) -> None:
    # The byte model puts all probability on one token, but the params must be valid and go through the sampler.
    a = completion(client, prompt="x", max_tokens=5, temperature=1.0, top_k=5, top_p=0.5, seed=7).json()
    assert a["usage"]["completion_tokens"] >= 1


@pytest.mark.parametrize(("body", "param"), [
    ({"n": 0}, "n"), ({"n": -1}, "n"), ({"echo": "yes"}, "echo"), ({"logprobs": 21}, "logprobs"),
    ({"logprobs": -1}, "logprobs"), ({"prompt_logprobs": 99}, "prompt_logprobs"),
    ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"), ({"n": 2, "best_of": 1}, "best_of"),
    ({"best_of": 3, "stream": True}, "best_of"), ({"suffix": "x"}, "suffix"),
    ({"repetition_penalty": 1.2}, "repetition_penalty"), ({"logit_bias": {"5": 1.0}}, "logit_bias"),
    ({"stream_options": {"include_usage": True}}, "stream_options"), ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"), ({"prompt": [[]]}, "prompt"), ({"prompt": 5}, "prompt"),
    ({"prompt": [1, "a"]}, "prompt"), ({"temperature": -1}, "temperature"), ({"top_p": 2.0}, "top_p"),
    ({"max_tokens": 0}, "max_tokens"), ({"max_tokens": "x"}, "max_tokens"), ({"prompt": [BOS, 9999]}, "prompt"),
    ({"stop": [""]}, "stop"), ({"top_k": -5}, "top_k"), ({"seed": 1.5}, "seed"),
])
def test_validation_errors_are_400(client: TestClient, body: dict, param: str | None) -> None:
    r = completion(client, **{"prompt": "hi", "max_tokens": 4, **body})
    err = assert_error(r, 400)
    if param is not None:
        assert err["param"] == param, err


def test_context_length_errors(client: TestClient) -> None:
    assert_error(completion(client, prompt=[BOS] * 256, max_tokens=1), 400, contains="maximum context length",
                 param="prompt")
    assert_error(completion(client, prompt="a" * 300), 400, contains="maximum context length")
    assert_error(completion(client, prompt="hi", max_tokens=257), 400, contains="maximum context length")


def test_malformed_bodies_and_limits(client: TestClient) -> None:
    r = client.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert_error(r, 400, contains="JSON")
    assert_error(client.post("/v1/completions", json=[1, 2]), 400)
    assert_error(client.post("/v1/completions", json={"model": SERVED}), 400, param="prompt")
    big = {"model": SERVED, "prompt": "x" * (70 * 1024)}
    assert_error(client.post("/v1/completions", json=big), 413)
    assert_error(completion(client, prompt=["a"] * 17, max_tokens=1), 400, param="prompt")  # test_limits.py


def test_unknown_model_and_route(client: TestClient) -> None:
    err = assert_error(completion(client, prompt="x", model="gpt-4"), 404, contains="does not exist")
    assert err["type"] == "NotFoundError"
    root = client.get("/v1/models").json()["data"][0]["root"]
    assert completion(client, prompt="x", max_tokens=1, model=root).status_code == 200  # root accepted as name
    assert client.post("/v1/completions", json={"prompt": "x", "max_tokens": 1}).status_code == 200  # no model
    assert_error(client.get("/v1/nope"), 404)


def test_api_key() -> None:
    with TestClient(make_fake_app(api_key="sekrit")) as c:
        body = {"prompt": "x", "max_tokens": 1}
        assert_error(c.post("/v1/completions", json=body), 401)
        assert_error(c.post("/v1/completions", json=body, headers={"Authorization": "Bearer nope"}), 401)
        assert_error(c.get("/v1/models"), 401)
        assert_error(c.post("/tokenize", json={"prompt": "x"}), 401)
        ok = {"Authorization": "Bearer sekrit"}
        assert c.post("/v1/completions", json=body, headers=ok).status_code == 200
        assert c.get("/v1/models", headers=ok).status_code == 200
        assert c.get("/health").status_code == 200 and c.get("/metrics").status_code == 200


def test_engine_death_gives_503() -> None:
    with TestClient(make_fake_app(fail_at_step=3)) as c:
        r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 10, "ignore_eos": True})
        assert_error(r, 503, contains="injected engine failure")
        assert c.get("/health").status_code == 503
        assert_error(c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2}), 503)
        assert "deepinfer:engine_alive{" in c.get("/metrics").text


def test_engine_death_mid_stream_sends_error_then_done() -> None:
    with TestClient(make_fake_app(fail_at_step=3)) as c:
        r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 10, "ignore_eos": True, "stream": True})
        events = sse_events(r.text)
        assert events[-1] == "[DONE]"
        assert "error" in json.loads(events[-2])
        assert sum(1 for e in events[:-2] if json.loads(e)["choices"]) == 2


def test_tokenize_detokenize(client: TestClient) -> None:
    r = client.post("/tokenize", json={"model": SERVED, "prompt": "héllo", "add_special_tokens": False}).json()
    assert r["tokens"] == TOK.encode("héllo", add_special_tokens=False) and r["count"] == len(r["tokens"])
    assert r["max_model_len"] == 256
    assert client.post("/tokenize", json={"prompt": "a"}).json()["tokens"][0] == BOS
    assert client.post("/detokenize", json={"model": SERVED, "tokens": r["tokens"]}).json() == {"prompt": "héllo"}
    assert_error(client.post("/detokenize", json={"tokens": [10**6]}), 400)
    assert_error(client.post("/tokenize", json={"prompt": "a", "model": "other"}), 404)


def test_metrics(client: TestClient) -> None:
    completion(client, prompt="abc", max_tokens=5, ignore_eos=True)
    text = client.get("/metrics").text
    values = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line and not line.startswith("#") and "finished_reason" not in line}
    assert values["deepinfer:generation_tokens_total"] == 5
    assert values["deepinfer:prompt_tokens_total"] == 4
    assert values["deepinfer:num_requests_running"] == 0 and values["deepinfer:num_requests_waiting"] == 0
    assert values["deepinfer:kv_cache_usage_perc"] == 0 and values["deepinfer:kv_blocks_total"] == 64
    assert 'deepinfer:request_success_total{model_name="fake-tiny",finished_reason="length"} 1' in text
    assert values["deepinfer:requests_total"] == 1
    assert values["deepinfer:time_to_first_token_seconds_count"] == 1
    assert 0 < values["deepinfer:time_to_first_token_seconds_sum"] < 5
    assert "# TYPE deepinfer:time_to_first_token_seconds summary" in text
