"""Every list / map field of a request has a maximum (server/protocol.py RequestLimits): at the limit accepted, one over
a 400 naming the field and the limit. Checked on the parsers with the default limits, and end to end through the
app (over the fake engine) with the fake's limits."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient

from deepinfer_bench.server.protocol import APIError, RequestLimits, parse_chat_request, parse_completion_request
from tests.server.fakes import SERVED, ByteTokenizer, make_chat_app

LIMITS = RequestLimits()
TOK = ByteTokenizer()


def test_default_limits_are_the_documented_ones() -> None:
    """README and the RequestLimits docstring state these numbers; a change must change them too."""
    assert (LIMITS.stop, LIMITS.stop_chars, LIMITS.stop_token_ids, LIMITS.prompts, LIMITS.sequences,
            LIMITS.messages, LIMITS.tools, LIMITS.tool_calls, LIMITS.logprobs) == (16, 128, 256, 256, 256, 2048, 128,
                                                                                    128, 20)
    with pytest.raises(ValueError, match="stop"):
        RequestLimits(stop=0)


def _msgs(n: int) -> list[dict[str, Any]]:
    return [{"role": "user" if i % 2 == 0 else "assistant", "content": "x"} for i in range(n)]


def _tools(n: int) -> list[dict[str, Any]]:
    return [{"type": "function", "function": {"name": f"f{i}", "parameters": {}}} for i in range(n)]


def _calls(n: int) -> list[dict[str, Any]]:
    return [{"id": f"c{i}", "type": "function", "function": {"name": "f", "arguments": "{}"}} for i in range(n)]


# (endpoint, field the error names, body with `k` items in that field, the limit)
CASES = [
    ("completions", "stop", lambda k: {"stop": [f"s{i}" for i in range(k)]}, LIMITS.stop),
    ("completions", "stop", lambda k: {"stop": "x" * k}, LIMITS.stop_chars),  # one string's characters
    ("completions", "stop", lambda k: {"stop": ["ab", "y" * k]}, LIMITS.stop_chars),
    ("completions", "stop_token_ids", lambda k: {"stop_token_ids": list(range(k))}, LIMITS.stop_token_ids),
    ("completions", "prompt", lambda k: {"prompt": ["a"] * k}, LIMITS.prompts),
    ("completions", "prompt", lambda k: {"prompt": [[1, 2]] * k}, LIMITS.prompts),
    ("completions", "n", lambda k: {"prompt": "a", "n": k}, LIMITS.sequences),
    ("completions", "best_of", lambda k: {"prompt": "a", "best_of": k}, LIMITS.sequences),
    ("chat", "messages", lambda k: {"messages": _msgs(k)}, LIMITS.messages),
    ("chat", "tools", lambda k: {"messages": _msgs(1), "tools": _tools(k)}, LIMITS.tools),
    ("chat", "messages[0].tools", lambda k: {"messages": [{"role": "system", "content": "", "tools": _tools(k)},
                                                          *_msgs(1)]}, LIMITS.tools),
    ("chat", "messages[1].tool_calls", lambda k: {"messages": [*_msgs(1), {"role": "assistant", "content": "",
                                                                           "tool_calls": _calls(k)}]},
     LIMITS.tool_calls),
    ("chat", "n", lambda k: {"messages": _msgs(1), "n": k}, LIMITS.sequences),
]


def _parse(endpoint: str, body: dict[str, Any]) -> Any:
    if endpoint == "completions":
        return parse_completion_request({"prompt": "hi", **body}, LIMITS)
    return parse_chat_request(body, LIMITS)


@pytest.mark.parametrize(("endpoint", "param", "body", "limit"), CASES,
                         ids=[f"{c[0]}-{c[1]}-{i}" for i, c in enumerate(CASES)])
def test_limit_accepted_at_and_refused_one_over(endpoint: str, param: str, body: Any, limit: int) -> None:
    _parse(endpoint, body(limit))
    with pytest.raises(APIError) as e:
        _parse(endpoint, body(limit + 1))
    assert e.value.status == 400 and e.value.param == param and str(limit) in e.value.message, e.value.body()


@pytest.mark.parametrize("body", [{"logit_bias": {"5": 1.0}}, {"allowed_token_ids": [5]}, {"bad_words": ["x"]}])
def test_unsupported_maps_and_lists_hold_nothing(body: dict[str, Any]) -> None:
    """logit_bias / allowed_token_ids / bad_words are not implemented: empty or null only (a 400 names the field)."""
    (name, value), = body.items()
    parse_completion_request({"prompt": "hi", name: {} if isinstance(value, dict) else []}, LIMITS)
    parse_completion_request({"prompt": "hi", name: None}, LIMITS)
    with pytest.raises(APIError) as e:
        parse_completion_request({"prompt": "hi", **body}, LIMITS)
    assert e.value.status == 400 and e.value.param == name and "not supported" in e.value.message


def _error(r: Any, param: str, limit: int) -> None:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and str(limit) in err["message"] and err["type"] == "BadRequestError", err


def test_limits_through_the_app(client: TestClient) -> None:
    """The fake app (prompts / sequences limits 16, the rest the defaults)."""
    def post(**body: Any) -> Any:
        return client.post("/v1/completions", json={"model": SERVED, "max_tokens": 2, **body})

    stops = [f"#{i}" for i in range(LIMITS.stop)]
    r = post(prompt="hello", stop=stops, stream=True)
    assert r.status_code == 200 and r.text.endswith("data: [DONE]\n\n")
    _error(post(prompt="hello", stop=["#"] * 10_000), "stop", LIMITS.stop)  # the issue's probe (fits 64 KiB)
    _error(post(prompt="hello", stop="z" * (LIMITS.stop_chars + 1)), "stop", LIMITS.stop_chars)
    assert post(prompt="hello", stop_token_ids=list(range(1, LIMITS.stop_token_ids + 1))).status_code == 200
    _error(post(prompt="hello", stop_token_ids=list(range(LIMITS.stop_token_ids + 1))), "stop_token_ids",
           LIMITS.stop_token_ids)
    assert len(post(prompt=["a"] * 16, max_tokens=1).json()["choices"]) == 16
    _error(post(prompt=["a"] * 17, max_tokens=1), "prompt", 16)
    assert len(post(prompt=["a"] * 4, n=4, max_tokens=1).json()["choices"]) == 16
    _error(post(prompt=["a"] * 4, n=5, max_tokens=1), "n", 16)
    r = post(prompt="a", logit_bias={str(i): 1.0 for i in range(300)})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias"
    (a,) = TOK.encode("a", add_special_tokens=False)
    assert client.post("/detokenize", json={"tokens": [a] * 256}).json() == {"prompt": "a" * 256}  # max_model_len
    _error(client.post("/detokenize", json={"tokens": [a] * 257}), "tokens", 256)


def test_chat_limits_through_the_app() -> None:
    """Over the limits only (at them, 128 tool schemas or 2048 messages do not fit this fake's 1024-token context:
    the parser test above accepts them)."""
    with TestClient(make_chat_app("Hello.")) as c:
        def chat(**body: Any) -> Any:
            return c.post("/v1/chat/completions", json={"model": SERVED, "max_tokens": 4, **body})

        assert chat(messages=_msgs(1), tools=_tools(2)).status_code == 200
        _error(chat(messages=_msgs(1), tools=_tools(LIMITS.tools + 1)), "tools", LIMITS.tools)
        _error(chat(messages=_msgs(LIMITS.messages + 1)), "messages", LIMITS.messages)
        assert chat(messages=_msgs(1), n=4).status_code == 200
        _error(chat(messages=_msgs(1), n=LIMITS.sequences + 1), "n", LIMITS.sequences)
