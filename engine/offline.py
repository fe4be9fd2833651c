"""Offline batch generation, vLLM's shape: `LLM(config).generate(prompts, params)` over an engine built the one way
(`engine.build`, engine/launch.py)."""

from __future__ import annotations

from collections.abc import Sequence as SequenceABC
from typing import Any

from engine.config import EngineConfig
from engine.launch import build
from engine.llm import LLMEngine, ModelRunnerLike, RequestOutput, RequestRejected, SamplingParams

__all__ = ["LLM"]


class LLM:
    """Offline batch generation: `LLM(config).generate(prompts, params)` (vLLM's shape)."""

    def __init__(self, config: EngineConfig, runner: ModelRunnerLike | None = None, **overrides: Any) -> None:
        """`overrides`: flat engine settings applied to `config` (EngineConfig.replace). Without `runner` (tests
        pass a fake one) the engine is built by `engine.build`, which sets the process up first."""
        if overrides:
            config = config.replace(**overrides)
        self.engine = build(config) if runner is None else LLMEngine(config, runner)

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
