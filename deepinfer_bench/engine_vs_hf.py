"""`deepinfer bench engine-vs-hf`: the engine and the HF transformers reference, timed side by side in one run on
the same weights. Returns data; the CLI renders it.

Measured, interleaved (engine, HF, engine, HF, ...; medians), with the same torch thread count on both sides:
* batch-1 greedy decode, ms per token, for every engine graph mode and for HF; the engine's batch-B decode;
* prefill: TTFT of one `prefill_len`-token prompt (engine: one prefill step; HF: one forward, last logits);
* bytes: the weight bytes a decode step reads (the engine's as held in memory - FP8/FP4 bytes under
  `--weights stored`; HF's at its dtype; routed experts: min(local experts, B x K) per layer, the embedding B rows),
  the achieved GB/s they imply, and the machine's own read bandwidth from a copy probe run in this process, so the
  table says how close each side is to the memory roof.
The engine runs `config` (its dtype, weights, kernels, moe); HF runs the dequantised weights at the same dtype.
"""

from __future__ import annotations

import time
from typing import Any

import pandas as pd
import torch

from engine.profiling import quantiles

COLUMNS = ["system", "weights", "dtype", "batch_size", "prompt_len", "decode_steps", "ms_per_step_p50",
           "ms_per_step_p90", "ms_per_token_p50", "decode_tok_s", "weight_bytes_per_step", "achieved_gb_s",
           "roof_fraction"]
PREFILL_COLUMNS = ["system", "prompt_len", "repeats", "ttft_ms_p50", "ttft_ms_p90", "prefill_tok_s"]
TARGET_B1_RATIO = 0.5  # engine batch-1 ms/token <= 0.5 x HF's
TARGET_BATCH_SPEEDUP = 10.0  # engine batch-B decode tok/s >= 10 x its own batch-1
TARGET_TTFT_RATIO = 0.5  # engine TTFT of the long prompt <= 0.5 x HF's


def memory_bandwidth_gb_s(mib: int = 1024, repeats: int = 3) -> float:
    """Read bandwidth of this process on this machine: the best of `repeats` sums over a `mib`-MiB fp32 buffer
    (larger than the caches), in GB/s, with the current torch thread count."""
    buf = torch.ones(mib * 2**20 // 4)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - t0)
    return buf.numel() * 4 / best / 1e9


def engine_read_bytes(model: Any, batch: int) -> int:
    """Weight bytes one decode step of `batch` tokens reads from the engine's model as it is held (stored bytes,
    scales included): every tensor of the main layers and the head once, the embedding `batch` rows, and per layer
    min(local experts, batch x K) routed experts."""
    total = 0
    for name, t in model.named_parameters():
        if name.startswith("mtp.") or ".ffn.experts." in name:
            continue
        b = t.numel() * t.element_size()
        total += b // t.shape[0] * batch if name == "embed.weight" else b
    for layer in model.layers:
        moe = layer.ffn
        ex = moe.experts[moe.local.start]
        per = sum(p.numel() * p.element_size() for p in ex.parameters())
        total += min(len(moe.local), batch * moe.topk) * per
    return total


def hf_read_bytes(cfg: Any, element_size: int, batch: int) -> int:
    """The same count for the HF model: logical (dequantised) tensors at `element_size` bytes each."""
    from engine.loader import expected_tensors, expert_of

    total = per_expert = 0
    for name, shape in expected_tensors(cfg, include_mtp=False).items():
        n = 1
        for s in shape:
            n *= s
        ex = expert_of(name)
        if ex is not None:
            per_expert += n * element_size if ex[0] == 0 and name.startswith("layers.0.") else 0
            continue
        total += n * element_size // shape[0] * batch if name == "embed.weight" else n * element_size
    k = min(cfg.n_routed_experts, batch * cfg.n_activated_experts)
    return total + cfg.n_layers * k * per_expert


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


@torch.inference_mode()
def _engine_ttft(runner, prompt_len: int, seed: int) -> float:
    from engine.model.cache import SeqStep

    g = torch.Generator().manual_seed(seed)
    runner.free_slot(0)
    step = [SeqStep(slot=0, start=0, n=prompt_len, token_start=0,
                    block_table=torch.arange(-(-prompt_len // runner.block_size)))]
    ids = torch.randint(2, runner.cfg.vocab_size, (prompt_len,), generator=g)
    t0 = time.perf_counter()
    runner.forward(step, ids).argmax(-1)
    return time.perf_counter() - t0


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


@torch.no_grad()
def _hf_ttft(model, prompt_len: int, seed: int, vocab: int) -> float:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, vocab, (1, prompt_len), generator=g)
    t0 = time.perf_counter()
    model(input_ids=ids, use_cache=True, logits_to_keep=1).logits.argmax(-1)
    return time.perf_counter() - t0


def engine_settings(cfg: Any, batch: int, prompt_len: int, steps: int, prefill_len: int = 0) -> dict[str, Any]:
    """Engine sizes for the run: `batch` slots, the context of prefill + decode (or the long prefill), a pool twice
    that, and a step budget for the long prompt in one step."""
    from engine.config import default_block_size

    max_len = max(prompt_len + steps + 1, prefill_len)
    per_seq = -(-max_len // default_block_size(cfg))
    return {"max_num_seqs": batch, "num_kv_blocks": batch * per_seq * 2, "max_model_len": max_len,
            "max_num_batched_tokens": max(512, batch * prompt_len, prefill_len)}


def run_speed(config: Any, *, prompt_len: int = 64, steps: int = 64, batch: int = 32, repeats: int = 3,
              threads: int = 1, graph_modes: tuple[str, ...] = ("eager", "layer"), prefill_len: int = 0,
              ) -> tuple[pd.DataFrame, pd.DataFrame, dict[str, float]]:
    """Returns (decode table, prefill table, ratios). `prefill_len` 0: no prefill measurement. Graph modes other
    than `eager` compile region graphs during the warm-up, which is not timed."""
    import engine as engine_pkg
    from deepinfer_bench.reference import build_hf_model
    from engine.launch import load_weights
    from engine.runner import parse_dtype

    torch.set_num_threads(threads)
    cfg = config.model.config
    dtype = parse_dtype(config.model.dtype)
    bandwidth = memory_bandwidth_gb_s()
    hf = build_hf_model(cfg, load_weights(config, stored=False), dtype=dtype)
    state = load_weights(config)
    runners = {mode: engine_pkg.build(config.replace(graph_mode=mode), weights=state, threads=threads).runner
               for mode in graph_modes}
    del state
    samples: dict[tuple[str, int], list[float]] = {}
    ttft: dict[str, list[float]] = {}
    for runner in runners.values():  # warm up (and compile) every shape that is timed
        _engine_decode_times(runner, 1, prompt_len, 2, 0)
        _engine_decode_times(runner, batch, prompt_len, 2, 0)
    _hf_decode_times(hf, prompt_len, 2, 0, cfg.vocab_size)
    for r in range(repeats):
        for mode, runner in runners.items():
            samples.setdefault((f"deepinfer[{mode}]", 1), []).extend(
                _engine_decode_times(runner, 1, prompt_len, steps, r))
        samples.setdefault(("hf-transformers", 1), []).extend(
            _hf_decode_times(hf, prompt_len, steps, r, cfg.vocab_size))
        for mode, runner in runners.items():
            samples.setdefault((f"deepinfer[{mode}]", batch), []).extend(
                _engine_decode_times(runner, batch, prompt_len, steps, r))
        if prefill_len:
            ttft.setdefault("deepinfer[eager]", []).append(_engine_ttft(next(iter(runners.values())), prefill_len, r))
            ttft.setdefault("hf-transformers", []).append(_hf_ttft(hf, prefill_len, r, cfg.vocab_size))
    model = next(iter(runners.values())).model
    rows = []
    for (system, b), times in samples.items():
        p50, p90 = quantiles(times, 50, 90)
        is_hf = system.startswith("hf")
        nbytes = hf_read_bytes(cfg, dtype.itemsize, b) if is_hf else engine_read_bytes(model, b)
        gbs = nbytes / p50 / 1e9
        rows.append({"system": system, "weights": "dequant" if is_hf else str(config.model.weights),
                     "dtype": str(dtype).removeprefix("torch."), "batch_size": b, "prompt_len": prompt_len,
                     "decode_steps": len(times), "ms_per_step_p50": p50 * 1e3, "ms_per_step_p90": p90 * 1e3,
                     "ms_per_token_p50": p50 * 1e3 / b, "decode_tok_s": b / p50, "weight_bytes_per_step": nbytes,
                     "achieved_gb_s": gbs, "roof_fraction": gbs / bandwidth})
    df = pd.DataFrame(rows, columns=COLUMNS)
    pre = pd.DataFrame([{"system": s, "prompt_len": prefill_len, "repeats": len(v),
                         "ttft_ms_p50": quantiles(v, 50)[0] * 1e3, "ttft_ms_p90": quantiles(v, 90)[0] * 1e3,
                         "prefill_tok_s": prefill_len / quantiles(v, 50)[0]} for s, v in ttft.items()],
                       columns=PREFILL_COLUMNS)
    h1 = df[df.system == "hf-transformers"].iloc[0]
    ratios: dict[str, float] = {"b1_target": TARGET_B1_RATIO, "batch_target": TARGET_BATCH_SPEEDUP,
                                "ttft_target": TARGET_TTFT_RATIO, "torch_threads": threads,
                                "memory_bandwidth_gb_s": bandwidth}
    for mode in graph_modes:
        e1 = df[(df.system == f"deepinfer[{mode}]") & (df.batch_size == 1)].iloc[0]
        eb = df[(df.system == f"deepinfer[{mode}]") & (df.batch_size == batch)].iloc[0]
        ratios[f"{mode}:b1_ms_per_token_engine_over_hf"] = float(e1.ms_per_token_p50 / h1.ms_per_token_p50)
        ratios[f"{mode}:b{batch}_tok_s_over_b1"] = float(eb.decode_tok_s / e1.decode_tok_s)
        ratios[f"{mode}:b1_ms_per_token_over_eager"] = float(
            e1.ms_per_token_p50 / df[(df.system == f"deepinfer[{graph_modes[0]}]") & (df.batch_size == 1)].iloc[0]
            .ms_per_token_p50)
    if len(pre) == 2:
        ratios["ttft_engine_over_hf"] = float(pre.ttft_ms_p50.iloc[0] / pre.ttft_ms_p50.iloc[1])
    return df, pre, ratios
