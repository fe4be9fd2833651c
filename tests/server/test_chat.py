"""`/v1/chat/completions`: messages rendered with DeepSeek-V4's encoding, the turn parsed back into
`reasoning_content` / `content` / `tool_calls`, streamed and not. The model is scripted (tests/server/fakes.py
`ScriptRunner`: it answers every prompt with a fixed text, then EOS) over the tiny model's real tokenizer."""

from __future__ import annotations

import json
import math

import pytest
from fastapi.testclient import TestClient

from engine.chat_encoding import DSML, encode_chat, encode_messages
from engine.tokenizer import load_tokenizer
from tests.server.fakes import SERVED, TINY, make_chat_app, make_fake_app
from tests.server.test_completions import assert_error, sse_events

TOK = load_tokenizer(TINY)
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}}]
CALL = (f"<{DSML}tool_calls>\n<{DSML}invoke name=\"get_weather\">\n"
        f"<{DSML}parameter name=\"city\" string=\"true\">Paris</{DSML}parameter>\n"
        f"<{DSML}parameter name=\"days\" string=\"false\">2</{DSML}parameter>\n</{DSML}invoke>\n</{DSML}tool_calls>")


def chat(script: str, **body: object) -> tuple[dict, list[dict], TestClient]:
    """The non-streamed reply and the streamed chunks of the same request, answered with `script`."""
    with TestClient(make_chat_app(script)) as c:
        req = {"model": SERVED, "messages": MESSAGES, "temperature": 0, **body}
        r = c.post("/v1/chat/completions", json=req)
        assert r.status_code == 200, r.text
        s = c.post("/v1/chat/completions", json={**req, "stream": True, "stream_options": {"include_usage": True}})
        assert s.status_code == 200 and s.headers["content-type"].startswith("text/event-stream")
        events = sse_events(s.text)
        assert events[-1] == "[DONE]"
        prompts = list(c.app.state.engine_loop.engine.runner.prompts.values())
    return r.json(), [json.loads(e) for e in events[:-1]], prompts


def joined(chunks: list[dict], field: str) -> str:
    return "".join(c["choices"][0]["delta"].get(field) or "" for c in chunks if c["choices"])


def test_chat_mode_prompt_reply_usage_and_stream() -> None:
    body, chunks, prompts = chat("Sunny, 21 C.")
    want_prompt = encode_chat(TOK, encode_messages(MESSAGES, thinking_mode="chat"))
    assert prompts == [want_prompt, want_prompt]  # the engine saw exactly DeepSeek-V4's encoding, no extra BOS
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    (c,) = body["choices"]
    assert c["message"] == {"role": "assistant", "content": "Sunny, 21 C.", "reasoning_content": None}
    assert c["finish_reason"] == "stop" and c["logprobs"] is None
    n_out = len(TOK.encode("Sunny, 21 C.", add_special_tokens=False)) + 1  # + EOS
    assert body["usage"] == {"prompt_tokens": len(want_prompt), "completion_tokens": n_out,
                             "total_tokens": len(want_prompt) + n_out}
    tokens = [ch for ch in chunks if ch["choices"]]
    assert len(tokens) == n_out  # one chunk per generated token, the first one carries the role
    assert tokens[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all("role" not in ch["choices"][0]["delta"] for ch in tokens[1:])
    assert all(ch["object"] == "chat.completion.chunk" for ch in chunks)
    assert joined(chunks, "content") == "Sunny, 21 C." and joined(chunks, "reasoning_content") == ""
    assert [ch["choices"][0]["finish_reason"] for ch in tokens] == [None] * (n_out - 1) + ["stop"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == body["usage"]


def test_thinking_mode_splits_reasoning_from_content() -> None:
    script = "The user wants weather. </think>It is sunny."
    kw = {"chat_template_kwargs": {"thinking": True}, "reasoning_effort": "max"}
    body, chunks, prompts = chat(script, **kw)
    prompt = encode_messages(MESSAGES, thinking_mode="thinking", reasoning_effort="max")
    assert prompt.endswith("<｜Assistant｜><think>") and "Reasoning Effort: Absolute maximum" in prompt
    assert prompts[0] == encode_chat(TOK, prompt)
    msg = body["choices"][0]["message"]
    assert msg["reasoning_content"] == "The user wants weather. " and msg["content"] == "It is sunny."
    assert joined(chunks, "reasoning_content") == msg["reasoning_content"]
    assert joined(chunks, "content") == msg["content"]
    for ch in chunks:  # no delta ever shows the marker
        assert "</think>" not in json.dumps(ch["choices"][0]["delta"] if ch["choices"] else {}, ensure_ascii=False)


def test_tool_calls_parsed_and_streamed_at_the_end() -> None:
    body, chunks, prompts = chat("Let me check.\n\n" + CALL, tools=TOOLS)
    assert prompts[0] == encode_chat(TOK, encode_messages(MESSAGES, thinking_mode="chat", tools=TOOLS))
    (c,) = body["choices"]
    assert c["finish_reason"] == "tool_calls" and c["message"]["content"] == "Let me check."
    (call,) = c["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris", "days": 2}
    assert joined(chunks, "content") == "Let me check."  # no DSML text leaks into the streamed content
    tokens = [ch for ch in chunks if ch["choices"]]
    last = tokens[-1]["choices"][0]
    assert last["finish_reason"] == "tool_calls"
    (streamed,) = last["delta"]["tool_calls"]
    assert streamed["index"] == 0 and streamed["function"] == call["function"]
    assert all("tool_calls" not in ch["choices"][0]["delta"] for ch in tokens[:-1])
    # tool_choice "none": the block stays text
    body, _, _ = chat("Let me check.\n\n" + CALL, tools=TOOLS, tool_choice="none")
    assert body["choices"][0]["finish_reason"] == "stop" and CALL in body["choices"][0]["message"]["content"]


def test_chat_logprobs_and_n() -> None:
    body, chunks, _ = chat("Hi there", logprobs=True, top_logprobs=2, n=2)
    assert [c["index"] for c in body["choices"]] == [0, 1]
    content = body["choices"][0]["logprobs"]["content"]
    ids = TOK.encode("Hi there", add_special_tokens=False) + [TOK.eos_token_id]
    assert [e["token"] for e in content] == [TOK.decode([t], skip_special_tokens=False) for t in ids]
    assert all(len(e["top_logprobs"]) == 2 and e["top_logprobs"][0]["token"] == e["token"] for e in content)
    lp = -math.log1p(1023 * math.exp(-5.0))  # the script's token has logit 0, the 1023 others -5
    assert all(e["logprob"] == pytest.approx(lp, abs=1e-5) for e in content)
    assert all(e["top_logprobs"][1]["logprob"] == pytest.approx(lp - 5.0, abs=1e-5) for e in content)
    assert body["usage"]["completion_tokens"] == 2 * len(ids)
    streamed = [e for ch in chunks if ch["choices"] and ch["choices"][0]["index"] == 0
                for e in ch["choices"][0]["logprobs"]["content"]]
    assert streamed == content


def test_chat_logprob_tokens_as_token_ids() -> None:
    body, _, _ = chat("Hi", logprobs=True, top_logprobs=1, return_tokens_as_token_ids=True)
    ids = TOK.encode("Hi", add_special_tokens=False) + [TOK.eos_token_id]
    assert [e["token"] for e in body["choices"][0]["logprobs"]["content"]] == [f"token_id:{t}" for t in ids]


@pytest.mark.parametrize(("body", "param", "contains"), [
    ({"messages": "hi"}, "messages", "valid list"),
    ({"messages": ["hi"]}, "messages.0", "valid dictionary"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages", "role"),
    ({"messages": [{"role": "user"}]}, "messages", "content"),
    ({"messages": []}, "messages", "empty"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "max_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs", "logprobs=true"),
    ({"n": 0}, "n", "at least 1"),
    ({"tool_choice": "required"}, "tool_choice", "not supported"),
    ({"chat_template_kwargs": {"thinking": "yes"}}, "chat_template_kwargs", "true or false"),
    ({"reasoning_effort": "extreme"}, "reasoning_effort", "reasoning_effort"),
    ({"max_completion_tokens": 0}, "max_tokens", "at least 1"),
])
def test_bad_chat_requests_are_400_and_the_server_stays_healthy(body: dict, param: str, contains: str) -> None:
    with TestClient(make_chat_app("ok")) as c:
        req = {"model": SERVED, "messages": MESSAGES, **body}
        assert_error(c.post("/v1/chat/completions", json=req), 400, contains=contains, param=param)
        assert c.get("/health").status_code == 200
        ok = c.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2, "temperature": 0})
        assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] == "ok"


def test_tokenizer_without_chat_tokens_is_a_clear_400() -> None:
    with TestClient(make_fake_app()) as c:  # a byte-level tokenizer: no single id for <｜User｜> & co
        r = c.post("/v1/chat/completions", json={"messages": MESSAGES})
        assert_error(r, 400, contains="lacks DeepSeek-V4's chat special tokens", param="messages")
        assert c.get("/health").status_code == 200
