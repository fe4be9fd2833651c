"""Engines over given weights for the engine tests: built the one way (`engine.build`), run the one way
(`greedy_with_logits`, the golden's loop through the scheduler)."""

from __future__ import annotations

import torch

import engine
from engine.config import EngineConfig, ModelConfig
from engine.llm import LLMEngine, greedy_with_logits


def config(cfg: ModelConfig, **settings) -> EngineConfig:
    """Defaults for the test models: 4 slots, a 64-block pool, whole prefills in one step."""
    base = {"max_num_seqs": 4, "num_kv_blocks": 64, "max_model_len": min(1024, cfg.max_position_embeddings)}
    return EngineConfig.from_model_config(cfg, **{**base, **settings})


def build(cfg: ModelConfig, weights: dict[str, torch.Tensor], **settings) -> LLMEngine:
    return engine.build(config(cfg, **settings), weights=weights)


def greedy(eng: LLMEngine, prompts: list[list[int]], new: int) -> tuple[list[list[int]], list[torch.Tensor]]:
    return greedy_with_logits(eng, prompts, new)
