"""`deepinfer generate`: one prompt through the full engine (scheduler, KV pool, sampler), on 1 or cp ranks."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _generate_job(engine: Any, prompt: str | list[int], params: Any) -> dict[str, Any]:
    ids = engine.encode(prompt)
    engine.add_request(ids, params, request_id="generate")
    final = None
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                final = out
    text = engine.tokenizer.decode(final.output_token_ids) if engine.tokenizer is not None else None
    return {"prompt_ids": ids, "output_ids": list(final.output_token_ids), "text": text,
            "finish_reason": final.finish_reason}


def generate(model_dir: str | Path, *, prompt: str | None = None, prompt_ids: list[int] | None = None,
             max_tokens: int = 32, temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0,
             seed: int | None = None, dtype: str = "float32", cp: int = 1) -> dict[str, Any]:
    """Returns {"prompt_ids", "output_ids", "text" (None without a tokenizer), "finish_reason"}."""
    from engine.config import ModelConfig
    from engine.launch import run_engine_job
    from engine.llm import EngineConfig
    from engine.parallel import check_layout
    from engine.runner import default_block_size
    from engine.sampler import SamplingParams

    cfg = ModelConfig.from_json(Path(model_dir))
    check_layout(cfg, cp)
    # a byte-level tokenizer yields at most one token per byte (+ BOS): a safe bound before tokenising
    n_prompt = len(prompt_ids) if prompt_ids is not None else len((prompt or "").encode()) + 2
    max_len = min(cfg.max_position_embeddings, n_prompt + max_tokens)
    bs = default_block_size(cfg, cp)
    config = EngineConfig(model_dir=str(model_dir), dtype=dtype, max_num_seqs=1, num_kv_blocks=-(-max_len // bs),
                          block_size=bs, max_model_len=max_len, cp=cp, max_num_batched_tokens=max(512, n_prompt))
    params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed, max_tokens=max_tokens)
    return run_engine_job(config, _generate_job, (prompt if prompt is not None else prompt_ids, params))
