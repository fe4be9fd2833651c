"""A fake engine and a byte-level tokenizer with the real engine's contract, so server tests run in seconds.

`FakeEngine` follows `engine.llm.LLMEngine`: `add_request` (raises `RequestRejected`), `abort`, `step` returning
RequestOutput-shaped records, `has_unfinished`, `stats()`. It keeps a KV block pool so tests can check that
aborts and disconnects give blocks back. Its "model" is a hash of the last tokens: deterministic per prompt,
independent of batching, and it sometimes emits a two-byte UTF-8 character split over two tokens.
"""

from __future__ import annotations

import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path

from deepinfer_bench.server import ServerConfig, create_app
from engine.sampler import SamplingParams
from engine.scheduler import RequestRejected

BOS, EOS, OFFSET = 1, 2, 3  # byte b is token b + OFFSET
VOCAB = 256 + OFFSET


class ByteTokenizer:
    """UTF-8 bytes as tokens; BOS prepended when add_special_tokens."""

    eos_token_id = EOS
    vocab_size = VOCAB

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return ([BOS] if add_special_tokens else []) + [b + OFFSET for b in text.encode()]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(t - OFFSET for t in ids if t >= OFFSET).decode("utf-8", errors="replace")


def next_token(history: list[int]) -> int:
    if history[-1] == 0xC3 + OFFSET:
        return 0xA9 + OFFSET  # completes "é"
    h = zlib.crc32(bytes(t % 256 for t in history[-4:])) % 40
    if h < 26:
        return ord("a") + h + OFFSET
    return {26: ord(" "), 27: 0xC3, 28: ord("."), 29: EOS - OFFSET}.get(h, ord(" ")) + OFFSET


@dataclass
class FakeOutput:
    request_id: str
    new_token_ids: list[int]
    output_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    prompt_len: int


@dataclass
class _Req:
    rid: str
    prompt: list[int]
    params: SamplingParams
    out: list[int] = field(default_factory=list)

    def blocks(self, block_size: int) -> int:
        return -(-(len(self.prompt) + len(self.out) + 1) // block_size)


class FakeEngine:
    def __init__(self, *, max_num_seqs: int = 8, num_kv_blocks: int = 64, block_size: int = 16,
                 max_model_len: int = 256, step_delay_s: float = 0.0, fail_at_step: int | None = None,
                 reject_token: int | None = None) -> None:
        self.max_num_seqs, self.num_kv_blocks, self.block_size = max_num_seqs, num_kv_blocks, block_size
        self.max_model_len = max_model_len
        self.step_delay_s, self.fail_at_step, self.reject_token = step_delay_s, fail_at_step, reject_token
        self.waiting: list[_Req] = []
        self.running: list[_Req] = []
        self.num_steps = 0
        self.max_batch_seen = 0
        self._n = 0

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None) -> str:
        total = len(prompt_token_ids) + params.max_tokens
        if self.reject_token is not None and self.reject_token in prompt_token_ids:
            raise RequestRejected(f"token {self.reject_token} is not allowed (test)")
        if total > self.max_model_len:
            raise RequestRejected(f"prompt ({len(prompt_token_ids)} tokens) + max_tokens ({params.max_tokens}) = "
                                  f"{total} exceeds the maximum context length max_model_len={self.max_model_len}")
        self._n += 1
        rid = request_id or f"req-{self._n}"
        self.waiting.append(_Req(rid, list(prompt_token_ids), params))
        return rid

    def abort(self, request_id: str) -> None:
        self.waiting = [r for r in self.waiting if r.rid != request_id]
        self.running = [r for r in self.running if r.rid != request_id]

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def used_blocks(self) -> int:
        return sum(r.blocks(self.block_size) for r in self.running)

    def stats(self) -> dict[str, float]:
        return {"num_running": len(self.running), "num_waiting": len(self.waiting),
                "num_used_blocks": self.used_blocks(), "num_total_blocks": self.num_kv_blocks}

    def step(self) -> list[FakeOutput]:
        self.num_steps += 1
        if self.fail_at_step is not None and self.num_steps >= self.fail_at_step:
            raise RuntimeError("injected engine failure")
        while self.waiting and len(self.running) < self.max_num_seqs and \
                self.used_blocks() + self.waiting[0].blocks(self.block_size) <= self.num_kv_blocks:
            self.running.append(self.waiting.pop(0))
        self.max_batch_seen = max(self.max_batch_seen, len(self.running))
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        outs = []
        for r in list(self.running):
            tok = next_token(r.prompt + r.out)
            r.out.append(tok)
            p = r.params
            reason = None
            if (tok == EOS and not p.ignore_eos) or tok in p.stop_token_ids:
                reason = "stop"
            elif len(r.out) >= p.max_tokens:
                reason = "length"
            if reason:
                self.running.remove(r)
            outs.append(FakeOutput(r.rid, [tok], list(r.out), reason is not None, reason, len(r.prompt)))
        return outs


def offline_greedy(prompt_ids: list[int], max_tokens: int, ignore_eos: bool = False) -> list[int]:
    """What the fake engine generates for one request alone."""
    eng = FakeEngine(max_model_len=10**6, num_kv_blocks=10**6)
    eng.add_request(prompt_ids, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=ignore_eos))
    out: list[int] = []
    while eng.has_unfinished():
        for o in eng.step():
            out = o.output_token_ids
    return out


SERVED = "fake-tiny"


def make_fake_app(api_key: str | None = None, **engine_kw: object):
    """App factory (also used as `uvicorn --factory tests.server.fakes:make_fake_app`)."""
    engine = FakeEngine(**engine_kw)  # type: ignore[arg-type]
    cfg = ServerConfig(served_model_name=SERVED, model_root=str(Path(__file__).parent.resolve()),
                       max_model_len=engine.max_model_len, vocab_size=VOCAB, api_key=api_key, max_body_bytes=64 * 1024,
                       max_prompts_per_request=16)
    app = create_app(engine, ByteTokenizer(), cfg, make_sampling_params=SamplingParams)
    app.state.fake_engine = engine
    return app


def make_slow_app():
    return make_fake_app(step_delay_s=0.005, num_kv_blocks=64)


def fake_engine(kw: dict) -> FakeEngine:
    return FakeEngine(**kw)


def make_slow_process_app():
    """Same as make_slow_app, with the engine in a child process (ProcessEngineLoop)."""
    from deepinfer_bench.engine_process import ProcessEngineLoop

    kw = {"step_delay_s": 0.005, "num_kv_blocks": 64}
    loop = ProcessEngineLoop(fake_engine, (kw,))
    info = loop.launch(timeout_s=60)
    cfg = ServerConfig(served_model_name=SERVED, model_root=str(Path(__file__).parent.resolve()),
                       max_model_len=info["max_model_len"], vocab_size=VOCAB, max_body_bytes=64 * 1024,
                       max_prompts_per_request=16)
    return create_app(None, ByteTokenizer(), cfg, make_sampling_params=SamplingParams, engine_loop=loop)


def make_auth_app():
    return make_fake_app(api_key="sekrit")
