"""Engine vs the HF transformers reference, timed in the same run on the same tiny model (issue: "speed worth
having"): batch-1 greedy decode time per token, and batched decode throughput. Returns data; the CLI renders it.

Both sides run fp32 on the same dequantised weights, after the same prefill, with the same torch thread count.
Measurements are interleaved (engine, HF, engine, HF, ...) so a busy machine hurts both alike; medians are reported.
"""

from __future__ import annotations

import time
from typing import Any

import pandas as pd
import torch

from engine.profiling import quantiles

COLUMNS = ["system", "batch_size", "prompt_len", "decode_steps", "ms_per_step_p50", "ms_per_step_p90",
           "ms_per_token_p50", "decode_tok_s"]
TARGET_B1_RATIO = 0.5  # engine batch-1 ms/token <= 0.5 x HF's
TARGET_BATCH_SPEEDUP = 10.0  # engine batch-32 decode tok/s >= 10 x its own batch-1


@torch.inference_mode()
def _engine_decode_times(runner, batch: int, prompt_len: int, steps: int, seed: int) -> list[float]:
    from engine.model.cache import SeqStep

    g = torch.Generator().manual_seed(seed)
    per_seq = -(-(prompt_len + steps + 1) // runner.block_size)
    tables = [torch.arange(i * per_seq, (i + 1) * per_seq) for i in range(batch)]
    for slot in range(batch):
        runner.free_slot(slot)
    prefill = [SeqStep(slot=i, start=0, n=prompt_len, token_start=i * prompt_len, block_table=tables[i])
               for i in range(batch)]
    logits = runner.forward(prefill, torch.randint(2, runner.cfg.vocab_size, (batch * prompt_len,), generator=g))
    times = []
    for t in range(steps):
        ids = logits.argmax(-1)  # [B] greedy
        step = [SeqStep(slot=i, start=prompt_len + t, n=1, token_start=i, block_table=tables[i]) for i in range(batch)]
        t0 = time.perf_counter()
        logits = runner.forward(step, ids)
        times.append(time.perf_counter() - t0)
    return times


@torch.no_grad()
def _hf_decode_times(model, prompt_len: int, steps: int, seed: int, vocab: int) -> list[float]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, vocab, (1, prompt_len), generator=g)
    out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
    times = []
    for t in range(steps):
        nxt = out.logits[:, -1].argmax(-1, keepdim=True)  # [1, 1]
        pos = torch.tensor([[prompt_len + t]])
        t0 = time.perf_counter()
        out = model(input_ids=nxt, position_ids=pos, cache=out.cache, use_cache=True, logits_to_keep=1)
        times.append(time.perf_counter() - t0)
    return times


def engine_settings(cfg: Any, batch: int, prompt_len: int, steps: int) -> dict[str, Any]:
    """Engine sizes for the run: `batch` slots, the context of prefill + decode, and a pool twice that."""
    from engine.config import default_block_size

    max_len = prompt_len + steps + 1
    per_seq = -(-max_len // default_block_size(cfg))
    return {"max_num_seqs": batch, "num_kv_blocks": batch * per_seq * 2, "max_model_len": max_len,
            "max_num_batched_tokens": max(512, batch * prompt_len)}


def run_speed(config: Any, *, prompt_len: int = 64, steps: int = 64, batch: int = 32,
              repeats: int = 3, threads: int = 1,
              graph_modes: tuple[str, ...] = ("eager", "layer")) -> tuple[pd.DataFrame, dict[str, float]]:
    """Interleaved repeats of: engine batch 1 (each graph mode), HF batch 1, engine batch `batch` (each graph mode).
    Returns the table and the ratios per graph mode. `config`: the engine (fp32 against HF's fp32); each graph mode
    is `config.replace(graph_mode=...)` over the same loaded weights.

    `threads` torch intra-op threads for both sides (default 1: the tiny model's ops are far too small to split, and
    on a busy 2-core box OpenMP spin-waits make multi-threaded timings erratic). Graph modes other than `eager`
    compile region graphs (engine/regions.py) during the warm-up, which is not timed."""
    import engine as engine_pkg
    from deepinfer_bench.reference import build_hf_model
    from engine.launch import load_weights

    torch.set_num_threads(threads)
    cfg = config.model.config
    state = load_weights(config)
    runners = {mode: engine_pkg.build(config.replace(graph_mode=mode), weights=state, threads=threads).runner
               for mode in graph_modes}
    hf = build_hf_model(cfg, state, dtype=torch.float32)
    samples: dict[tuple[str, int], list[float]] = {}
    for runner in runners.values():  # warm up (and compile) every shape that is timed
        _engine_decode_times(runner, 1, prompt_len, steps, 0)
        _engine_decode_times(runner, batch, prompt_len, steps, 0)
    _hf_decode_times(hf, prompt_len, 4, 0, cfg.vocab_size)
    for r in range(repeats):
        for mode, runner in runners.items():
            samples.setdefault((f"deepinfer[{mode}]", 1), []).extend(
                _engine_decode_times(runner, 1, prompt_len, steps, r))
        samples.setdefault(("hf-transformers", 1), []).extend(
            _hf_decode_times(hf, prompt_len, steps, r, cfg.vocab_size))
        for mode, runner in runners.items():
            samples.setdefault((f"deepinfer[{mode}]", batch), []).extend(
                _engine_decode_times(runner, batch, prompt_len, steps, r))
    rows = []
    for (system, b), times in samples.items():
        p50, p90 = quantiles(times, 50, 90)
        rows.append({"system": system, "batch_size": b, "prompt_len": prompt_len, "decode_steps": len(times),
                     "ms_per_step_p50": p50 * 1e3, "ms_per_step_p90": p90 * 1e3, "ms_per_token_p50": p50 * 1e3 / b,
                     "decode_tok_s": b / p50})
    df = pd.DataFrame(rows, columns=COLUMNS)
    h1 = df[df.system == "hf-transformers"].iloc[0]
    ratios: dict[str, float] = {"b1_target": TARGET_B1_RATIO, "batch_target": TARGET_BATCH_SPEEDUP,
                                "torch_threads": threads}
    for mode in graph_modes:
        e1 = df[(df.system == f"deepinfer[{mode}]") & (df.batch_size == 1)].iloc[0]
        eb = df[(df.system == f"deepinfer[{mode}]") & (df.batch_size == batch)].iloc[0]
        ratios[f"{mode}:b1_ms_per_token_engine_over_hf"] = float(e1.ms_per_token_p50 / h1.ms_per_token_p50)
        ratios[f"{mode}:b{batch}_tok_s_over_b1"] = float(eb.decode_tok_s / e1.decode_tok_s)
    return df, ratios
