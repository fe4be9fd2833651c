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

from deepinfer_bench.server.api import create_app
from deepinfer_bench.server.protocol import RequestLimits
from deepinfer_bench.server.settings import ServerConfig
from engine.sampler import SamplingParams
from tests.fake_runner import BOS, EOS, OFFSET, ByteTokenizer, FakeRunner, byte_engine, byte_greedy
from tests.fake_runner import BYTE_VOCAB as VOCAB

__all__ = ["BOS", "EOS", "OFFSET", "SERVED", "VOCAB", "ByteTokenizer", "make_engine", "make_fake_app",
           "offline_greedy"]

make_engine = byte_engine  # the real engine over the byte model; kwargs: pool sizes, step_delay_s, fail_at_step
offline_greedy = byte_greedy  # what it generates for one request alone, without scheduler or engine


SERVED = "fake-tiny"


def server_config(max_model_len: int, api_key: str | None = None) -> ServerConfig:
    return ServerConfig(served_model_name=SERVED, model_root=str(Path(__file__).parent.resolve()),
                        max_model_len=max_model_len, vocab_size=VOCAB, api_key=api_key, max_body_bytes=64 * 1024,
                        limits=RequestLimits(prompts=16, sequences=16))


def make_fake_app(api_key: str | None = None, **engine_kw: object):
    """App factory (also used as `uvicorn --factory tests.server.fakes:make_fake_app`); the engine on a thread
    (`app.state.engine_loop.engine`)."""
    engine = make_engine(**engine_kw)  # type: ignore[arg-type]
    cfg = server_config(engine.config.cache.max_model_len, api_key)
    return create_app(engine, ByteTokenizer(), cfg, make_sampling_params=SamplingParams)


def make_slow_app():
    return make_fake_app(step_delay_s=0.005, num_kv_blocks=64)


def make_slow_process_app(step_delay_s: float = 0.005):
    """Same as make_slow_app, with the engine in a child process (ProcessEngineLoop)."""
    from deepinfer_bench.server.engine_process import ProcessEngineLoop

    loop = ProcessEngineLoop(functools.partial(make_engine, step_delay_s=step_delay_s, num_kv_blocks=64))
    ready = loop.launch(timeout_s=60)
    return create_app(None, ByteTokenizer(), server_config(ready.max_model_len), make_sampling_params=SamplingParams,
                      engine_loop=loop)


def make_auth_app():
    return make_fake_app(api_key="sekrit")


# ---- logprobs and chat --------------------------------------------------------------------------------------------
IDS_VOCAB = 97


def make_ids_app(num_speculative_tokens: int = 0, enable_prefix_caching: bool = False, **engine_kw: object):
    """The real engine over `FakeRunner` (random logits after every prefix: logprobs are worth comparing), token ids
    only (no tokenizer: logprob tokens are "token_id:ID"). `app.state.engine_loop.engine.runner` has the reference.
    `num_speculative_tokens` > 0: speculative decoding with `SpecFakeRunner`'s partly wrong drafts."""
    from engine.llm import LLMEngine
    from tests.fake_runner import SpecFakeRunner, fake_config

    kw = {"max_num_seqs": 8, "budget": 16, "num_kv_blocks": 64, "block_size": 8, "max_model_len": 128, **engine_kw}
    spec = {"speculative": "mtp", "num_speculative_tokens": num_speculative_tokens} if num_speculative_tokens else {}
    cfg = fake_config(kw["max_num_seqs"], kw["budget"], kw["num_kv_blocks"], kw["block_size"], kw["max_model_len"],
                      vocab_size=IDS_VOCAB, enable_prefix_caching=enable_prefix_caching, **spec)
    runner = (SpecFakeRunner if spec else FakeRunner)(kw["max_num_seqs"], kw["num_kv_blocks"], kw["block_size"],
                                                      kw["max_model_len"], IDS_VOCAB)
    engine = LLMEngine(cfg, runner, tokenizer=None)
    scfg = ServerConfig(served_model_name=SERVED, model_root=str(Path(__file__).parent.resolve()),
                        max_model_len=kw["max_model_len"], vocab_size=IDS_VOCAB)
    return create_app(engine, None, scfg, make_sampling_params=SamplingParams)


TINY = Path(__file__).resolve().parents[2] / "golden" / "tiny"


class ScriptRunner(FakeRunner):
    """A 'model' that answers every prompt with `script` (token ids) and then EOS; records each prompt it saw."""

    def __init__(self, script: list[int], eos: int, **kw: object) -> None:
        super().__init__(**kw)  # type: ignore[arg-type]
        self.script, self.eos = script, eos
        self.prompts: dict[str, list[int]] = {}

    def execute(self, batch: list, full_logits=()):
        for seq, _ in batch:
            self.prompts[seq.seq_id] = list(seq.prompt_token_ids)
        return super().execute(batch, full_logits)

    def logits_for(self, seq, end: int, h: int):
        import torch

        i = end - seq.num_prompt_tokens
        out = torch.full((self.vocab_size,), -5.0)  # [V]: logprob of the script's token -log(1 + 1023 e^-5)
        out[self.script[i] if 0 <= i < len(self.script) else self.eos] = 0.0
        return out


def make_chat_app(script_text: str):
    """The real engine over `ScriptRunner` answering `script_text` (tokenized by the tiny model's tokenizer, which
    has DeepSeek-V4's chat special tokens) with that tokenizer: chat rendering and parsing end to end."""
    from engine.llm import LLMEngine
    from engine.tokenizer import load_tokenizer
    from tests.fake_runner import fake_config

    tok = load_tokenizer(TINY)
    vocab, eos = 1024, tok.eos_token_id
    cfg = fake_config(4, 512, 128, 16, 1024, vocab_size=vocab, eos_token_id=eos)
    runner = ScriptRunner(tok.encode(script_text, add_special_tokens=False), eos, max_num_seqs=4, num_kv_blocks=128,
                          block_size=16, max_model_len=1024, vocab_size=vocab)
    engine = LLMEngine(cfg, runner, tokenizer=tok)
    scfg = ServerConfig(served_model_name=SERVED, model_root=str(TINY), max_model_len=1024, vocab_size=vocab)
    return create_app(engine, tok, scfg, make_sampling_params=SamplingParams)
