"""The DeepSeek-V4 engine. `engine.build(config)` -> LLMEngine; `engine.run_job(config, fn, args)` runs
`fn(engine, *args)` on 1 or cp ranks (engine/launch.py). The config: `engine.config.EngineConfig.from_model_dir`.
Importing `engine` is light (no torch-xla / torch-neuronx / model code until something is built)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.config import EngineConfig
    from engine.llm import LLMEngine

__all__ = ["build", "run_job"]


def build(config: EngineConfig, **kwargs: Any) -> LLMEngine:
    from engine.launch import build as _build

    return _build(config, **kwargs)


def run_job(config: EngineConfig, fn: Any, args: tuple = (), **kwargs: Any) -> Any:
    from engine.launch import run_job as _run_job

    return _run_job(config, fn, args, **kwargs)
