"""A real uvicorn process on 127.0.0.1 over the fake engine: real clients, disconnects, concurrency."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest

from deepinfer_bench.bench.serve_sweep import ServeMatrix, run_serve_matrix, send_completion
from tests.server.fakes import SERVED, VOCAB, ByteTokenizer, offline_greedy

TOK = ByteTokenizer()


def metrics(base: str) -> dict[str, float]:
    text = httpx.get(f"{base}/metrics", timeout=5).text
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            reason = name.split('finished_reason="')[1].split('"')[0] if "finished_reason" in name else ""
            out[name.split("{")[0] + (f":{reason}" if reason else "")] = float(value)
    return out


ABORTS = "deepinfer:request_success_total:abort"


def wait_idle(base: str, timeout_s: float = 5.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout_s
    while True:
        m = metrics(base)
        idle = m["deepinfer:num_requests_running"] == 0 and m["deepinfer:num_requests_waiting"] == 0
        if (idle and m["deepinfer:kv_blocks_used"] == 0) or time.monotonic() > deadline:
            return m
        time.sleep(0.05)


def test_openai_client(any_server: str) -> None:
    client = openai.OpenAI(base_url=f"{any_server}/v1", api_key="unused", timeout=20, max_retries=0)
    assert client.models.list().data[0].id == SERVED
    want = TOK.decode(offline_greedy(TOK.encode("Hi"), 10, ignore_eos=True))
    r = client.completions.create(model=SERVED, prompt="Hi", max_tokens=10, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == want and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 10
    ids = TOK.encode("Hi")
    r = client.completions.create(model=SERVED, prompt=ids, max_tokens=10, extra_body={"ignore_eos": True})
    assert r.choices[0].text == want
    stream = client.completions.create(model=SERVED, prompt="Hi", max_tokens=10, stream=True,
                                       stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    stream = client.completions.create(model=SERVED, prompt=[ids, ids], max_tokens=4, stream=True,
                                       extra_body={"ignore_eos": True})
    by_index: dict[int, str] = {}
    for c in stream:
        by_index[c.choices[0].index] = by_index.get(c.choices[0].index, "") + c.choices[0].text
    assert by_index == {0: want[: len(by_index[0])], 1: want[: len(by_index[1])]} and len(by_index[0]) > 0
    stop = want[3:5]
    r = client.completions.create(model=SERVED, prompt="Hi", max_tokens=10, stop=[stop],
                                  extra_body={"ignore_eos": True})
    cut = want[: want.find(stop)]
    assert (r.choices[0].text, r.choices[0].finish_reason, r.choices[0].stop_reason) == (cut, "stop", stop)
    stream = client.completions.create(model=SERVED, prompt="Hi", max_tokens=10, stop=stop, stream=True,
                                       extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == cut and chunks[-1].choices[0].stop_reason == stop
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="Hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.completions.create(model=SERVED, prompt=[1] * 300, max_tokens=2)


def test_vllm_style_parser(live_server: str) -> None:
    """The request function mirrors vllm/benchmarks/lib/endpoint_request_func.py."""

    async def go():
        async with httpx.AsyncClient(timeout=20) as c:
            payload = {"model": SERVED, "prompt": "some random text \ufffd\x01 odd", "repetition_penalty": 1.0,
                       "max_tokens": 12, "logprobs": None, "stream": True, "ignore_eos": True,
                       "stream_options": {"include_usage": True}}
            ok = await send_completion(c, f"{live_server}/v1/completions", payload, {"x-request-id": "bench-1"}, 5)
            bad = await send_completion(c, f"{live_server}/v1/completions", {**payload, "n": 0}, None, 5)
            return ok, bad

    ok, bad = asyncio.run(go())
    assert ok.success, ok.error
    assert ok.output_tokens == 12 and len(ok.itl) == 11 and ok.prompt_len == len(TOK.encode(
        "some random text \ufffd\x01 odd"))
    assert 0 < ok.ttft <= ok.latency
    assert not bad.success and bad.error == "Bad Request"


def test_client_disconnect_mid_stream_frees_blocks(any_server: str) -> None:
    body = {"model": SERVED, "prompt": "disconnect me", "max_tokens": 200, "ignore_eos": True, "stream": True}
    aborts = metrics(any_server).get(ABORTS, 0)
    with httpx.Client(timeout=10) as c, c.stream("POST", f"{any_server}/v1/completions", json=body) as r:
        seen = 0
        for line in r.iter_lines():
            if line.startswith("data: "):
                seen += 1
            if seen == 3:
                m = metrics(any_server)
                assert m["deepinfer:num_requests_running"] == 1 and m["deepinfer:kv_blocks_used"] > 0
                break
    m = wait_idle(any_server)
    assert m["deepinfer:num_requests_running"] == 0 and m["deepinfer:kv_blocks_used"] == 0
    assert m["deepinfer:kv_cache_usage_perc"] == 0
    assert m[ABORTS] == aborts + 1  # aborted, not run to completion


def test_client_disconnect_non_stream_frees_blocks(live_server: str) -> None:
    body = {"model": SERVED, "prompt": "wait for me", "max_tokens": 240, "ignore_eos": True}
    aborts = metrics(live_server).get(ABORTS, 0)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{live_server}/v1/completions", json=body, timeout=httpx.Timeout(5, read=0.3))
    m = wait_idle(live_server)
    assert m["deepinfer:num_requests_running"] == 0 and m["deepinfer:kv_blocks_used"] == 0
    assert m[ABORTS] == aborts + 1


def test_64_concurrent_streams_batched_and_exact(any_server: str) -> None:
    prompts = [TOK.encode(f"request number {i}") for i in range(64)]
    steps0 = metrics(any_server)["deepinfer:engine_steps_total"]

    async def one(c: httpx.AsyncClient, ids: list[int]) -> tuple[list[str], list[int], str]:
        body = {"model": SERVED, "prompt": ids, "max_tokens": 16, "ignore_eos": True, "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True}
        texts, out_ids, last = [], [], ""
        async with c.stream("POST", f"{any_server}/v1/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    last = line[6:]
                    if last != "[DONE]":
                        d = json.loads(last)
                        if d["choices"]:
                            texts.append(d["choices"][0]["text"])
                            out_ids += d["choices"][0]["token_ids"]
        return texts, out_ids, last

    async def go():
        async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=64)) as c:
            return await asyncio.gather(*(one(c, p) for p in prompts))

    results = asyncio.run(go())
    for ids, (texts, out_ids, last) in zip(prompts, results, strict=True):
        want = offline_greedy(ids, 16, ignore_eos=True)
        assert last == "[DONE]" and len(texts) == 16 and out_ids == want
        assert "".join(texts) == TOK.decode(want)
    steps = metrics(any_server)["deepinfer:engine_steps_total"] - steps0
    assert steps < 64 * 16 / 4, f"{steps} steps for 1024 tokens: requests were not batched"  # max_num_seqs = 8


def test_bench_serve_against_live_server(live_server: str) -> None:
    m = ServeMatrix(name="t", concurrency=(1, 4), input_len=(8,), output_len=(6, 300), min_prompts=4,
                    prompts_per_concurrency=1, warmup=1, waves=True)
    df, info = run_serve_matrix(live_server, m)
    assert info.model == SERVED and info.max_model_len == 256 and info.vocab_size == VOCAB
    ok = df[df.status == "ok"]
    assert len(ok) == 2 and (ok.completed == 4).all() and (ok.mean_output_tokens == 6).all()
    assert (ok.mean_prompt_tokens == 8).all()
    for col in ("ttft_ms_p50", "ttft_ms_p90", "tpot_ms_p50", "itl_ms_p50", "e2el_ms_p50"):
        assert (ok[col] > 0).all(), col
    assert (ok.e2el_ms_p50 >= ok.ttft_ms_p50).all()
    skipped = df[df.output_len == 300]
    assert (skipped.status == "skipped").all() and skipped.skip_reason.str.contains("max_model_len").all()
