"""`deepinfer generate`: one prompt through the full engine (scheduler, KV pool, sampler), on 1 or cp ranks.

`run_generate(args, prompt, params)` does the whole job for the command: checks the prompt before any engine is
built (ids against the vocabulary, chat needs a tokenizer with the chat tokens), renders a chat message with
DeepSeek-V4's chat encoding, sizes the engine for the one request, generates, parses a chat reply, and optionally
writes generate.csv + meta.json (timing, resident weight bytes, peak RSS)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.config import Workload


@dataclass(frozen=True)
class Prompt:
    """What the user asked to generate from: text, token ids, or a chat message (text rendered with the chat
    encoding; `thinking`: thinking mode)."""

    text: str | None = None
    ids: tuple[int, ...] | None = None
    chat: bool = False
    thinking: bool = False

    @classmethod
    def parse(cls, text: str | None, ids: str | None, chat: bool = False, thinking: bool = False) -> Prompt:
        """From the command line: exactly one of `text` / `ids` ("1,2,3"); --chat / --thinking take text."""
        if (text is None) == (ids is None):
            raise ValueError("give exactly one of --prompt or --prompt-ids")
        if (chat or thinking) and text is None:
            raise ValueError("--chat / --thinking take the user message as --prompt")
        parsed = None
        if ids is not None:
            try:
                parsed = tuple(int(x) for x in ids.split(",") if x.strip())
            except ValueError:
                raise ValueError(f"--prompt-ids {ids!r}: expected comma-separated integers") from None
            if not parsed:
                raise ValueError("--prompt-ids is empty")
        return cls(text=text, ids=parsed, chat=chat or thinking, thinking=thinking)

    @property
    def mode(self) -> str:
        return "thinking" if self.thinking else "chat"


def workload(cfg: Any, n_prompt: int, max_tokens: int) -> Workload:
    """One request: one slot, its whole context, its prefill in one step."""
    max_len = n_prompt + max_tokens
    return Workload(max_num_seqs=1, max_model_len=max_len, pool_tokens=max_len,
                    max_num_batched_tokens=max(512, n_prompt))


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
    return sum(f.stat().st_size for f in Path(model_dir).glob("*.safetensors"))


def _generate_job(engine: Any, prompt: str | list[int], params: Any) -> dict[str, Any]:
    ids = engine.encode(prompt)
    engine.add_request(ids, params, request_id="generate")
    final, t0 = None, time.perf_counter()
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                final = out
    model = engine.runner.model
    spec = engine.spec_stats
    return {"prompt_ids": ids, "output_ids": list(final.output_token_ids),
            "acceptance_rate": spec.acceptance_rate if spec.num_draft_tokens else None,
            "speculative": {k: v for k, v in spec.to_dict().items() if k != "acceptance_rate"}
            if engine.config.spec.enabled else None, "engine_steps": engine.stats().num_steps,
            "text": final.text if engine.tokenizer is not None else None, "finish_reason": final.finish_reason,
            "seconds": time.perf_counter() - t0,
            "resident_weight_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
            "kv_cache_bytes": engine.runner.cache.nbytes(),
            "kv_cache_bytes_per_token": engine.runner.cache.bytes_per_token, "peak_rss_bytes": peak_rss_bytes()}


def generate(config: Any, prompt: str | list[int], params: Any) -> dict[str, Any]:
    """Returns {"prompt_ids", "output_ids", "text" (None without a tokenizer), "finish_reason", ...}."""
    from engine import run_job

    return run_job(config, _generate_job, (prompt, params))


def run_generate(args: Any, prompt: Prompt, params: Any, out: Path | None = None) -> dict[str, Any]:
    """The `deepinfer generate` job for the command's engine options `args` (deepinfer_bench/cli/options.py
    EngineArgs). The result has "text" (the reply's content for a chat prompt, with "message" holding the parsed
    reply), "output_ids", ...; with `out`, also "results" (the CSV path) and the resource row."""
    from engine.llm import check_token_ids

    cfg = args.model_config()
    request: str | list[int]
    if prompt.ids is not None:
        request = check_token_ids(prompt.ids, cfg.vocab_size)  # before any engine is built: one line, exit 2
    elif prompt.chat:
        request = chat_prompt_ids(args.model_dir, prompt.text, prompt.mode)
    else:
        request = prompt.text
    # a byte-level tokenizer yields at most one token per byte (+ BOS): a safe bound before tokenising
    n_prompt = len(request) if isinstance(request, list) else len(request.encode()) + 2
    config = args.config(cfg, workload=workload(cfg, n_prompt, params.max_tokens))
    result = generate(config, request, params)
    if out is not None:
        result.update(_save(args, config, result, out))
    if prompt.chat:
        from engine.chat_encoding import parse_completion

        parsed = parse_completion(result["text"], thinking_mode=prompt.mode, tools=False)
        result["message"] = {"role": "assistant", "reasoning_content": parsed.reasoning_content,
                             "content": parsed.content}
        result["text"] = parsed.content
    return result


def _save(args: Any, config: Any, result: dict[str, Any], out: Path) -> dict[str, Any]:
    import pandas as pd

    from deepinfer_bench.bench.report import save_results

    ckpt = checkpoint_bytes(args.model_dir)
    row = {"prompt_len": len(result["prompt_ids"]), "output_len": len(result["output_ids"]),
           "seconds": result["seconds"], "weights": str(config.model.weights), "dtype": str(config.model.dtype),
           "checkpoint_bytes": ckpt, "resident_weight_bytes": result["resident_weight_bytes"],
           "kv_cache_bytes": result["kv_cache_bytes"], "kv_cache_bytes_per_token": result["kv_cache_bytes_per_token"],
           "kv_cache_dtype": str(config.cache.kv_cache_dtype), "peak_rss_bytes": result["peak_rss_bytes"],
           "peak_rss_over_checkpoint": result["peak_rss_bytes"] / ckpt if ckpt else float("nan")}
    path = save_results(pd.DataFrame([row]), out, "generate", {"engine_config": config.to_dict(), **row})
    return {"results": str(path), "checkpoint_bytes": ckpt,
            "peak_rss_over_checkpoint": row["peak_rss_over_checkpoint"]}
