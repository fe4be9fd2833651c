"""The real `LLMEngine` over a fake runner, and a byte-level tokenizer, so server tests run in seconds.

Everything the server talks to is the real engine: scheduler, KV block pool, sampler, detokenizer, stop strings
and stop tokens (engine/llm.py). Only the model is fake: tests/fake_runner.py's `ByteRunner` (the `FakeRunner`
contract checks over a byte-level "model": deterministic per prompt, independent of batching, sometimes EOS and a
two-byte UTF-8 character split over two tokens) with `ByteTokenizer` (UTF-8 bytes as tokens).

What the server tests need of a fake is done in the runner: `step_delay_s` (slow steps), `fail_at_step` (that
step raises: the engine loop dies). A rejected request is a real one: a prompt that can never fit the KV pool
(`RequestRejected` from the engine's scheduler).
"""

from __future__ import annotations

import functools
from pathlib import Path

from deepinfer_bench.server import ServerConfig, create_app
from engine.sampler import SamplingParams
from tests.fake_runner import BOS, EOS, OFFSET, ByteTokenizer, byte_engine, byte_greedy
from tests.fake_runner import BYTE_VOCAB as VOCAB

__all__ = ["BOS", "EOS", "OFFSET", "SERVED", "VOCAB", "ByteTokenizer", "make_engine", "make_fake_app",
           "offline_greedy"]

make_engine = byte_engine  # the real engine over the byte model; kwargs: pool sizes, step_delay_s, fail_at_step
offline_greedy = byte_greedy  # what it generates for one request alone, without scheduler or engine


SERVED = "fake-tiny"


def server_config(max_model_len: int, api_key: str | None = None) -> ServerConfig:
    return ServerConfig(served_model_name=SERVED, model_root=str(Path(__file__).parent.resolve()),
                        max_model_len=max_model_len, vocab_size=VOCAB, api_key=api_key, max_body_bytes=64 * 1024,
                        max_prompts_per_request=16)


def make_fake_app(api_key: str | None = None, **engine_kw: object):
    """App factory (also used as `uvicorn --factory tests.server.fakes:make_fake_app`); the engine on a thread
    (`app.state.engine_loop.engine`)."""
    engine = make_engine(**engine_kw)  # type: ignore[arg-type]
    cfg = server_config(engine.config.cache.max_model_len, api_key)
    return create_app(engine, ByteTokenizer(), cfg, make_sampling_params=SamplingParams)


def make_slow_app():
    return make_fake_app(step_delay_s=0.005, num_kv_blocks=64)


def make_slow_process_app():
    """Same as make_slow_app, with the engine in a child process (ProcessEngineLoop)."""
    from deepinfer_bench.engine_process import ProcessEngineLoop

    loop = ProcessEngineLoop(functools.partial(make_engine, step_delay_s=0.005, num_kv_blocks=64))
    ready = loop.launch(timeout_s=60)
    return create_app(None, ByteTokenizer(), server_config(ready.max_model_len), make_sampling_params=SamplingParams,
                      engine_loop=loop)


def make_auth_app():
    return make_fake_app(api_key="sekrit")
