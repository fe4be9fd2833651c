"""vLLM-shaped facade: `LLMEngine` (add_request / abort / step, for serving) and `LLM(config).generate(...)`.

One `step()` = schedule (pure Python) -> reset released slots -> `runner.execute(batch)` -> one batched sampler
call for the sequences whose chunk reached their last token -> stop checks -> free finished sequences. The runner
is built lazily from the config by `engine.runner.build_runner(config)`, or passed in (tests pass a fake one).
"""

from __future__ import annotations

import itertools
import random
import time
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from engine.sampler import Sampler, SamplingParams, make_generator
from engine.scheduler import RequestRejected, ScheduledBatch, Scheduler, SchedulerConfig
from engine.sequence import Sequence
from engine.tokenizer import Tokenizer, load_tokenizer

if TYPE_CHECKING:
    import torch

    from engine.config import ModelConfig

__all__ = ["EngineConfig", "EngineStats", "LLM", "LLMEngine", "RequestOutput", "RequestRejected", "SamplingParams"]


class ModelRunnerLike(Protocol):
    max_num_seqs: int
    num_kv_blocks: int
    block_size: int
    max_model_len: int

    def execute(self, batch: list[tuple[Sequence, int]]) -> torch.Tensor: ...

    def free_slot(self, slot: int) -> None: ...


@dataclass(frozen=True)
class EngineConfig:
    model_dir: str | None = None
    dtype: str = "float32"  # activations / weights on the host: float32 | bfloat16
    max_num_seqs: int = 8  # fixed KV slots = largest batch
    max_num_batched_tokens: int = 512  # per-step token budget (chunked prefill)
    num_kv_blocks: int = 64  # fixed KV pool size
    block_size: int = 128  # token positions per block; a multiple of every compress ratio
    max_model_len: int = 4096
    cp: int = 1  # context-parallel ranks
    seed: int = 0  # seeds unseeded requests' generators (and dummy weights)
    backend: str = "auto"  # auto | host | neuron
    load_format: str = "safetensors"  # safetensors | dummy

    def __post_init__(self) -> None:
        if self.model_dir is not None:
            object.__setattr__(self, "model_dir", str(self.model_dir))  # accept a Path, store a str
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype must be 'float32' or 'bfloat16', got {self.dtype!r}")
        if self.backend not in ("auto", "host", "neuron"):
            raise ValueError(f"backend must be 'auto', 'host' or 'neuron', got {self.backend!r}")
        if self.load_format not in ("safetensors", "dummy"):
            raise ValueError(f"load_format must be 'safetensors' or 'dummy', got {self.load_format!r}")
        if not isinstance(self.cp, int) or self.cp < 1:
            raise ValueError(f"cp must be a positive int, got {self.cp!r}")
        if not isinstance(self.seed, int):
            raise ValueError(f"seed must be an int, got {self.seed!r}")
        self.scheduler_config  # validates the scheduling fields  # noqa: B018

    @property
    def scheduler_config(self) -> SchedulerConfig:
        return SchedulerConfig(max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
                               num_kv_blocks=self.num_kv_blocks, block_size=self.block_size,
                               max_model_len=self.max_model_len)


@dataclass(frozen=True)
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    output_token_ids: list[int]
    finished: bool
    finish_reason: str | None  # 'stop' | 'length' | 'abort' once finished
    prompt_len: int
    # Detokenised output ("" without a tokenizer): every step when stop strings are set (cut at the stop string),
    # else only in the final output.
    text: str = ""
    arrival_time: float = 0.0
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_kv_blocks: int
    num_used_blocks: int
    num_free_blocks: int
    peak_used_blocks: int  # high-water mark since the engine started or reset_peak_usage()
    kv_usage: float  # used / total blocks
    num_prefill_tokens: int  # tokens processed in prefill chunks (recomputation after preemption included)
    num_generated_tokens: int
    num_preemptions: int
    num_finished: int
    num_steps: int


@dataclass
class _Counters:
    prefill_tokens: int = 0
    generated_tokens: int = 0
    finished: int = 0
    steps: int = 0
    pending: list[RequestOutput] = field(default_factory=list)


class LLMEngine:
    def __init__(self, config: EngineConfig, runner: ModelRunnerLike | None = None, *,
                 tokenizer: Tokenizer | None = None, eos_token_id: int | None = None) -> None:
        self.config = config
        self.scheduler = Scheduler(config.scheduler_config)
        self.sampler = Sampler()
        self.model_config = _load_model_config(config.model_dir)
        if self.model_config is not None:
            bad = sorted({m for m in self.model_config.compress_ratios if m and config.block_size % m})
            if bad:
                raise ValueError(f"block_size={config.block_size} must be a multiple of every compress ratio "
                                 f"(not of {bad})")
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(config.model_dir)
        if eos_token_id is None and self.model_config is not None:
            eos_token_id = self.model_config.eos_token_id
        if eos_token_id is None and self.tokenizer is not None:
            eos_token_id = self.tokenizer.eos_token_id
        self.eos_token_id = eos_token_id
        self._runner = None
        if runner is not None:
            self._bind_runner(runner)
        self._requests: dict[str, Sequence] = {}
        self._ids = itertools.count()
        self._rng = random.Random(config.seed)
        self._c = _Counters()

    # ---- runner ---------------------------------------------------------------------------------------------
    @property
    def runner(self) -> ModelRunnerLike:
        if self._runner is None:
            from engine.runner import build_runner

            self._bind_runner(build_runner(self.config))
        return self._runner  # type: ignore[return-value]

    def _bind_runner(self, runner: ModelRunnerLike) -> None:
        cfg = self.config
        for name in ("max_num_seqs", "num_kv_blocks", "max_model_len"):
            have = getattr(runner, name, None)
            if have is not None and have < getattr(cfg, name):
                raise ValueError(f"runner.{name}={have} < config.{name}={getattr(cfg, name)}")
        if getattr(runner, "block_size", cfg.block_size) != cfg.block_size:
            raise ValueError(f"runner.block_size={runner.block_size} != config.block_size={cfg.block_size}")
        self._runner = runner

    @property
    def vocab_size(self) -> int:
        if self.model_config is not None:
            return self.model_config.vocab_size
        return int(self.runner.vocab_size)  # type: ignore[attr-defined]

    # ---- requests -------------------------------------------------------------------------------------------
    def encode(self, prompt: str | SequenceABC[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"text prompt given but the model directory ({self.config.model_dir}) has no "
                                 "tokenizer.json: pass token ids instead")
            return self.tokenizer.encode(prompt)
        return [int(t) for t in prompt]

    def add_request(self, prompt_token_ids: str | SequenceABC[int], params: SamplingParams | None = None,
                    request_id: str | None = None, *, arrival_time: float | None = None) -> str:
        """Queue a request; returns its id. Raises RequestRejected if it could never fit this engine."""
        params = params or SamplingParams()
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer (no tokenizer.json in the model directory); "
                             "use stop_token_ids")
        ids = self.encode(prompt_token_ids)
        order = next(self._ids)
        rid = str(order) if request_id is None else str(request_id)
        if rid in self._requests and not self._requests[rid].is_finished:
            raise ValueError(f"request id {rid!r} is already in use")
        try:
            self.scheduler.check_request(len(ids), params.max_tokens)
        except RequestRejected as e:
            raise RequestRejected(f"request {rid!r} rejected: {e}") from None
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        gen = None if params.greedy else make_generator(seed)
        seq = Sequence(rid, ids, params, arrival_time=arrival_time, order=order, generator=gen)
        self.scheduler.add(seq)
        self._requests[rid] = seq
        return rid

    def abort(self, request_id: str) -> bool:
        """Abort a request; its blocks and slot return at once. Its final output comes with the next step()."""
        seq = self._requests.get(request_id)
        if seq is None or seq.is_finished:
            return False
        self.scheduler.finish(seq, "abort")
        self._final_text(seq)
        self._release_slots()
        self._c.pending.append(self._output(seq, []))
        self._c.finished += 1
        return True

    def get_sequence(self, request_id: str) -> Sequence | None:
        return self._requests.get(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._c.pending)

    # ---- one step -------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one engine step; returns an output for every request that got a token or finished."""
        outputs, self._c.pending = self._c.pending, []
        batch = self.scheduler.schedule()
        self._release_slots()
        if batch.is_empty:
            return outputs
        outputs += self._execute(batch)
        self._release_slots()
        return outputs

    def _execute(self, batch: ScheduledBatch) -> list[RequestOutput]:
        sample = batch.sample_indices  # before advance(): chunks that end at the last token
        num_decode = sum(1 for s, n in batch.entries if n == 1 and s.num_output_tokens and s.num_uncomputed_tokens == 1)
        logits = self.runner.execute(batch.entries)  # [B, V] fp32
        self.scheduler.advance(batch)
        self._c.steps += 1
        self._c.prefill_tokens += batch.num_batched_tokens - num_decode
        if not sample:
            return []
        seqs = [batch.entries[i][0] for i in sample]
        tokens = self.sampler(logits[sample], [s.sampling_params for s in seqs],  # [Bs, V]
                              [s.generator for s in seqs])
        now = time.perf_counter()
        outputs = []
        for seq, tok in zip(seqs, tokens, strict=True):
            seq.append_token(tok, now)
            self._c.generated_tokens += 1
            reason = self._stop_reason(seq, tok)
            if reason is not None:
                self.scheduler.finish(seq, reason)
                self._c.finished += 1
                self._final_text(seq)
            outputs.append(self._output(seq, [tok]))
        return outputs

    def _stop_reason(self, seq: Sequence, tok: int) -> str | None:
        p = seq.sampling_params
        n = seq.num_output_tokens
        if self.tokenizer is not None and p.stop:
            seq.output_text = self.tokenizer.decode(seq.output_token_ids)
        if n >= p.min_tokens:
            if tok in p.stop_token_ids or (not p.ignore_eos and tok == self.eos_token_id):
                return "stop"
            if p.stop:
                # Only the tail can contain a new match; cut the text at the earliest stop string (vLLM).
                text = seq.output_text
                hits = [i for i in (text.find(s) for s in p.stop) if i >= 0]
                if hits:
                    seq.output_text = text[: min(hits)]
                    return "stop"
        if n >= p.max_tokens or seq.num_tokens >= self.config.max_model_len:
            return "length"
        return None

    def _final_text(self, seq: Sequence) -> None:
        # Without stop strings the text is decoded once, at the end (servers detokenise incrementally themselves).
        if self.tokenizer is not None and not seq.sampling_params.stop:
            seq.output_text = self.tokenizer.decode(seq.output_token_ids)

    def _output(self, seq: Sequence, new: list[int]) -> RequestOutput:
        return RequestOutput(request_id=seq.seq_id, new_token_ids=new, output_token_ids=seq.output_token_ids,
                             finished=seq.is_finished, finish_reason=seq.finish_reason,
                             prompt_len=seq.num_prompt_tokens, text=seq.output_text, arrival_time=seq.arrival_time,
                             first_token_time=seq.first_token_time, finished_time=seq.finished_time,
                             num_preemptions=seq.num_preemptions)

    def _release_slots(self) -> None:
        slots = self.scheduler.take_freed_slots()
        if slots and self._runner is not None:
            for slot in slots:
                self._runner.free_slot(slot)

    # ---- metrics --------------------------------------------------------------------------------------------
    def stats(self) -> EngineStats:
        bm = self.scheduler.block_manager
        return EngineStats(num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
                           num_kv_blocks=bm.num_blocks, num_used_blocks=bm.num_used_blocks,
                           num_free_blocks=bm.num_free_blocks, peak_used_blocks=bm.peak_used_blocks,
                           kv_usage=bm.usage,
                           num_prefill_tokens=self._c.prefill_tokens, num_generated_tokens=self._c.generated_tokens,
                           num_preemptions=self.scheduler.num_preemptions, num_finished=self._c.finished,
                           num_steps=self._c.steps)


    def reset_peak_usage(self) -> None:
        self.scheduler.block_manager.reset_peak()


class LLM:
    """Offline batch generation: `LLM(config).generate(prompts, params)` (vLLM's shape)."""

    def __init__(self, config: EngineConfig | None = None, runner: ModelRunnerLike | None = None, **kwargs) -> None:
        if config is None:
            config = EngineConfig(**kwargs)
        elif kwargs:
            config = replace(config, **kwargs)
        self.engine = LLMEngine(config, runner)

    def generate(self, prompts: SequenceABC[str] | SequenceABC[SequenceABC[int]],
                 params: SamplingParams | SequenceABC[SamplingParams] | None = None) -> list[RequestOutput]:
        """Run every prompt to completion; returns the final output of each, in prompt order.

        A list of ints is ONE prompt of token ids only inside the outer list: pass `[[1, 2, 3]]`, not `[1, 2, 3]`.
        Every prompt is checked before any is queued, so a rejected one (RequestRejected) queues nothing.
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            raise ValueError("prompts must be a list of strings or a list of token-id lists")
        n = len(prompts)
        plist = list(params) if isinstance(params, SequenceABC) else [params or SamplingParams()] * n
        if len(plist) != n:
            raise ValueError(f"{len(plist)} SamplingParams for {n} prompts")
        eng = self.engine
        ids = [eng.encode(p) for p in prompts]
        for i, (toks, p) in enumerate(zip(ids, plist, strict=True)):
            try:
                eng.scheduler.check_request(len(toks), p.max_tokens)
            except RequestRejected as e:
                raise RequestRejected(f"prompt {i} rejected: {e}") from None
        rids = [eng.add_request(toks, p) for toks, p in zip(ids, plist, strict=True)]
        final: dict[str, RequestOutput] = {}
        want = set(rids)
        while want - final.keys():
            for out in eng.step():
                if out.finished and out.request_id in want:
                    final[out.request_id] = out
        return [final[r] for r in rids]


def _load_model_config(model_dir: str | None) -> ModelConfig | None:
    if model_dir is None or not (Path(model_dir) / "config.json").exists():
        return None
    from engine.config import ModelConfig

    return ModelConfig.from_json(model_dir)
