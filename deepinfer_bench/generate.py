"""`deepinfer generate`: one prompt through the full engine (scheduler, KV pool, sampler), on 1 or cp ranks."""

from __future__ import annotations

from typing import Any


def engine_settings(cfg: Any, prompt: str | None, prompt_ids: list[int] | None, max_tokens: int,
                    cp: int = 1) -> dict[str, Any]:
    """Engine sizes for one request: one slot, its whole context, its prefill in one step."""
    from engine.config import default_block_size

    # a byte-level tokenizer yields at most one token per byte (+ BOS): a safe bound before tokenising
    n_prompt = len(prompt_ids) if prompt_ids is not None else len((prompt or "").encode()) + 2
    max_len = min(cfg.max_position_embeddings, n_prompt + max_tokens)
    return {"max_num_seqs": 1, "max_model_len": max_len, "num_kv_blocks": -(-max_len // default_block_size(cfg, cp)),
            "max_num_batched_tokens": max(512, n_prompt)}


def chat_prompt_ids(model_dir: Any, message: str, thinking_mode: str) -> list[int]:
    """A user message as DeepSeek-V4 chat prompt ids (the encoder /v1/chat/completions uses); ValueError if the
    model directory has no tokenizer or one without the chat special tokens."""
    from engine.chat_encoding import encode_chat, encode_messages
    from engine.tokenizer import load_tokenizer

    tok = load_tokenizer(model_dir)
    if tok is None:
        raise ValueError(f"--chat needs a tokenizer: {model_dir} has no tokenizer.json")
    return encode_chat(tok, encode_messages([{"role": "user", "content": message}], thinking_mode=thinking_mode))


def peak_rss_bytes() -> int:
    """This process's peak resident set size so far (Linux reports KiB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def checkpoint_bytes(model_dir: Any) -> int:
    """Bytes of the safetensors files of a model directory (what the checkpoint is on disk)."""
    from pathlib import Path

    return sum(f.stat().st_size for f in Path(model_dir).glob("*.safetensors"))


def _generate_job(engine: Any, prompt: str | list[int], params: Any) -> dict[str, Any]:
    import time

    ids = engine.encode(prompt)
    engine.add_request(ids, params, request_id="generate")
    final, t0 = None, time.perf_counter()
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                final = out
    model = engine.runner.model
    return {"prompt_ids": ids, "output_ids": list(final.output_token_ids),
            "text": final.text if engine.tokenizer is not None else None, "finish_reason": final.finish_reason,
            "seconds": time.perf_counter() - t0,
            "resident_weight_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
            "kv_cache_bytes": engine.runner.cache.nbytes(), "peak_rss_bytes": peak_rss_bytes()}


def generate(config: Any, prompt: str | list[int], params: Any) -> dict[str, Any]:
    """Returns {"prompt_ids", "output_ids", "text" (None without a tokenizer), "finish_reason"}."""
    from engine import run_job

    return run_job(config, _generate_job, (prompt, params))
