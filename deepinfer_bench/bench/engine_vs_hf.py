"""`deepinfer bench engine-vs-hf`: the engine and the HF transformers reference, timed side by side in one run on
the same weights. Returns data; the CLI renders it.

Measured, interleaved (engine, HF, engine, HF, ...; medians), with the same torch thread count on both sides:
* batch-1 greedy decode, ms per token, for every engine graph mode (and every other kernel table asked for) and
  for HF; the engine's batch-B decode for each B asked for (the
  engine through its own step - scheduler, runner, sampler - as every command drives it: bench/batch_run.py;
  HF: one forward with its cache and an argmax);
* prefill: TTFT of one `prefill_len`-token prompt (engine: queueing to the first token; HF: one forward, last
  logits);
* bytes: the weight bytes a decode step reads (the engine's as held in memory - FP8/FP4 bytes under
  `--weights stored`; HF's at its dtype; routed experts: min(local experts, B x K) per layer, the embedding B rows),
  the achieved GB/s they imply, and the machine's own read bandwidth from copy probes run in this process (before
  the timings and after each repeat; the roof is the best of them, their spread is reported: on a shared VM one
  probe read anywhere from 10.5 to 16.3 GB/s), so the table says how close each side is to the memory roof;
* multiply-adds: those of a decode step's weight GEMMs (`engine_step_fmas`), the rate they imply, and the rate an
  fp32 GEMM reaches here with the same thread count (`gemm_rate_g_s`, BLAS: the compute roof), so a row that is
  compute-bound (a batch, or a kernel whose decode costs more than its bytes) shows it beside the memory roof.
The engine runs `config` (its dtype, weights, kernels, moe); HF runs the dequantised weights at the same dtype.
"""

from __future__ import annotations

import time
from typing import Any

import pandas as pd
import torch

from deepinfer_bench.bench.batch_run import random_prompts, run_batch
from engine.config import Workload
from engine.envs import get_envs
from engine.host_memory import host_buffer, why_not
from engine.profiling import quantiles

COLUMNS = ["system", "kernels", "weights", "dtype", "batch_size", "prompt_len", "decode_steps", "ms_per_step_p50",
           "ms_per_step_p90", "ms_per_token_p50", "decode_tok_s", "weight_bytes_per_step", "achieved_gb_s",
           "roof_fraction", "gemm_fmas_per_step", "achieved_gfma_s", "gemm_fraction"]
PREFILL_COLUMNS = ["system", "prompt_len", "repeats", "ttft_ms_p50", "ttft_ms_p90", "prefill_tok_s"]
# Targets of issue 24 (host decode at the memory roof), the default command on the mid bench model, fp32, 1 thread:
TARGET_B1_RATIO = 0.25  # engine batch-1 ms/token <= 0.25 x HF fp32's
TARGET_B1_ROOF = 0.5  # engine batch-1 achieved GB/s of the stored bytes >= 0.5 x the copy probe's
TARGET_BATCH_SPEEDUP = {8: 4.0}  # engine batch-B decode tok/s >= 4 x its own batch-1, at B = 8 (other B: reported)
TARGET_TTFT_RATIO = 0.5  # engine TTFT of the long prompt <= 0.5 x HF's


def memory_bandwidth_gb_s(mib: int = 1024, repeats: int = 3) -> float:
    """Read bandwidth of this process on this machine: the best of `repeats` sums over a `mib`-MiB fp32 buffer
    (larger than the caches), in GB/s, with the current torch thread count. The buffer lies where the engine puts
    its host weights (engine/host_memory.py: on huge pages unless DEEPINFER_HOST_HUGE_PAGES=off or the kernel has no
    THP), so the roof is the one the weights could reach: on the Zen 4 VM 1 GiB read 30-32 GB/s on 4 KiB pages and
    35-36 on huge pages."""
    buf = host_buffer(mib * 2**20, get_envs().DEEPINFER_HOST_HUGE_PAGES)[0].view(torch.float32).fill_(1.0)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - t0)
    return buf.numel() * 4 / best / 1e9


def gemm_rate_g_s(n: int = 1024, repeats: int = 3) -> float:
    """Multiply-adds per second (G/s) an fp32 GEMM reaches in this process: the best of `repeats` n x n x n torch.mm
    with the current torch thread count (BLAS: 83-90 % of an FMA loop's rate on the Zen 4 VM), the compute roof a
    decode step's GEMMs are measured against."""
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(n, n, generator=g), torch.randn(n, n, generator=g)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - t0)
    return n ** 3 / best / 1e9


def engine_step_fmas(cfg: Any, model: Any, batch: int, last_pos: int | None = None) -> int:
    """Multiply-adds of the weight GEMMs of one decode step of `batch` tokens, from the model's logical shapes (a
    stored FP8 / FP4 weight counts its dequantised elements): per token every 2-D weight of the main layers and the
    head once (projections, compressors, the mHC mixes, the gate), n_activated_experts routed experts per layer; not
    the embedding (a row gather) nor the attention's score and value products (they grow with the context, not with
    the weights). With `last_pos`, the indexer's query weights skipped where `engine_read_bytes` skips them."""
    from engine.loader import expected_tensors, expert_of

    skip = _skipped_indexer(model, last_pos)
    dense = expert = 0
    for name, shape in expected_tensors(cfg, include_mtp=False).items():
        leaf = name.rsplit(".", 1)[-1]
        if len(shape) != 2 or name == "embed.weight" or name.startswith(skip) or not (
                leaf == "weight" or leaf.startswith("hc_") and leaf.endswith("_fn")):
            continue
        ex = expert_of(name)
        if ex is None:
            dense += shape[0] * shape[1]
        elif ex[0] == 0:
            expert += shape[0] * shape[1]  # expert 0's w1, w2, w3 of every layer: a token runs K such per layer
    return batch * (dense + cfg.n_activated_experts * expert)


def roof_summary(probes: list[float]) -> dict[str, float]:
    """The memory roof of a run from its copy probes (GB/s, in the order taken): the best one (what the machine
    streamed when least disturbed), with the lowest and the count beside it, so a reader sees how far the machine's
    own bandwidth moved while the timings ran."""
    return {"memory_bandwidth_gb_s": max(probes), "memory_bandwidth_min_gb_s": min(probes),
            "memory_probes": float(len(probes))}


def _skipped_indexer(model: Any, last_pos: int | None) -> tuple[str, ...]:
    """Name prefixes of the indexer query weights a decode step at `last_pos` does not read: those of layers whose
    top-k keeps every entry at that context (engine/model/attention.py `Attention.index_needed`); none without it."""
    return () if last_pos is None else tuple(
        f"layers.{i}.attn.indexer.{w}." for i, layer in enumerate(model.layers)
        if layer.attn.indexer is not None and not layer.attn.index_needed(last_pos) for w in ("wq_b", "weights_proj"))


def engine_read_bytes(model: Any, batch: int, last_pos: int | None = None) -> int:
    """Weight bytes one decode step of `batch` tokens reads from the engine's model as it is held (stored bytes,
    scales included): every tensor of the main layers and the head once, the embedding `batch` rows, and per layer
    min(local experts, batch x K) routed experts. With `last_pos` (the step's last position), not the indexer's
    query weights of layers whose top-k keeps every entry at that context (engine/model/attention.py
    `Attention.index_needed`: the step skips them)."""
    skip = _skipped_indexer(model, last_pos)
    total = 0
    for name, t in model.named_parameters():
        if name.startswith("mtp.") or ".ffn.experts." in name or name.startswith(skip):
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


def _engine_decode_times(engine: Any, batch: int, prompt_len: int, steps: int, seed: int) -> list[float]:
    """Seconds of each of `steps` decode steps of `batch` greedy requests through the engine's own step."""
    prompts = random_prompts(engine.vocab_size, batch, prompt_len, seed)
    return run_batch(engine, prompts, steps + 1).decode_steps_s[:steps]


def _engine_ttft(engine: Any, prompt_len: int, seed: int) -> float:
    """Seconds from queueing one `prompt_len`-token request to its first token (prefill + first sample)."""
    return run_batch(engine, random_prompts(engine.vocab_size, 1, prompt_len, seed), 1).ttft_s


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


def workload(batch: int, prompt_len: int, steps: int, prefill_len: int = 0) -> Workload:
    """`batch` slots, the context of prefill + decode (or the long prefill), and a step budget for the long prompt
    (or every prompt of the batch) in one step."""
    max_len = max(prompt_len + steps + 1, prefill_len)
    return Workload(max_num_seqs=batch, max_model_len=max_len, pool=((max_len,) * batch,),
                    max_num_batched_tokens=max(512, batch * prompt_len, prefill_len))


def run_engine_vs_hf(config: Any, *, prompt_len: int = 64, steps: int = 64, batch: int | tuple[int, ...] = 32,
                     repeats: int = 3, threads: int = 1, graph_modes: tuple[str, ...] = ("eager", "layer"),
                     prefill_len: int = 0, kernels_also: tuple[str, ...] = (),
                     ) -> tuple[pd.DataFrame, pd.DataFrame, dict[str, float]]:
    """Returns (decode table, prefill table, ratios). `batch`: the batch size(s) of the batched-decode measurement.
    `kernels_also`: other kernel tables (`--kernels`) timed in the same run beside `config`'s, for every graph mode
    (engines "deepinfer[<mode>,<kernels>]"). `prefill_len` 0: no prefill measurement. Graph modes other than `eager`
    compile region graphs during the warm-up, which is not timed."""
    import engine as engine_pkg
    from deepinfer_bench.bench.hf_reference import build_hf_model
    from engine.launch import load_weights
    from engine.runner import parse_dtype

    batches = (batch,) if isinstance(batch, int) else tuple(batch)
    torch.set_num_threads(threads)
    cfg = config.model.config
    dtype = parse_dtype(config.model.dtype)
    probes = [memory_bandwidth_gb_s()]
    gemm = [gemm_rate_g_s()]
    hf = build_hf_model(cfg, load_weights(config, stored=False), dtype=dtype)
    state = load_weights(config)
    variants = {mode: config.replace(graph_mode=mode) for mode in graph_modes}
    variants |= {f"{mode},{k}": config.replace(graph_mode=mode, kernels=k)
                 for mode in graph_modes for k in kernels_also}
    engines = {label: engine_pkg.build(c, weights=state, threads=threads) for label, c in variants.items()}
    del state
    samples: dict[tuple[str, int], list[float]] = {}
    ttft: dict[str, list[float]] = {}
    for eng in engines.values():  # warm up (and compile) every shape that is timed
        for b in (1, *batches):
            _engine_decode_times(eng, b, prompt_len, 2, 0)
    _hf_decode_times(hf, prompt_len, 2, 0, cfg.vocab_size)
    for r in range(repeats):
        for label, eng in engines.items():
            samples.setdefault((f"deepinfer[{label}]", 1), []).extend(
                _engine_decode_times(eng, 1, prompt_len, steps, r))
        samples.setdefault(("hf-transformers", 1), []).extend(
            _hf_decode_times(hf, prompt_len, steps, r, cfg.vocab_size))
        for b in batches:
            for label, eng in engines.items():
                samples.setdefault((f"deepinfer[{label}]", b), []).extend(
                    _engine_decode_times(eng, b, prompt_len, steps, r))
        if prefill_len:
            first = next(iter(engines))
            ttft.setdefault(f"deepinfer[{first}]", []).append(_engine_ttft(engines[first], prefill_len, r))
            ttft.setdefault("hf-transformers", []).append(_hf_ttft(hf, prefill_len, r, cfg.vocab_size))
        probes.append(memory_bandwidth_gb_s())
    gemm.append(gemm_rate_g_s())
    roof = roof_summary(probes) | {"gemm_rate_g_s": max(gemm)}
    bandwidth, rate = roof["memory_bandwidth_gb_s"], max(gemm)
    model = next(iter(engines.values())).runner.model
    rows = []
    for (system, b), times in samples.items():
        p50, p90 = quantiles(times, 50, 90)
        is_hf = system.startswith("hf")
        nbytes = hf_read_bytes(cfg, dtype.itemsize, b) if is_hf else engine_read_bytes(model, b, prompt_len + steps)
        gbs = nbytes / p50 / 1e9
        fmas = engine_step_fmas(cfg, model, b, prompt_len + steps)  # HF runs the same GEMMs
        kernels = "-" if is_hf else str(variants[system.removeprefix("deepinfer[").removesuffix("]")].kernels)
        rows.append({"system": system, "kernels": kernels, "weights": "dequant" if is_hf else str(config.model.weights),
                     "dtype": str(dtype).removeprefix("torch."), "batch_size": b, "prompt_len": prompt_len,
                     "decode_steps": len(times), "ms_per_step_p50": p50 * 1e3, "ms_per_step_p90": p90 * 1e3,
                     "ms_per_token_p50": p50 * 1e3 / b, "decode_tok_s": b / p50, "weight_bytes_per_step": nbytes,
                     "achieved_gb_s": gbs, "roof_fraction": gbs / bandwidth, "gemm_fmas_per_step": fmas,
                     "achieved_gfma_s": fmas / p50 / 1e9, "gemm_fraction": fmas / p50 / 1e9 / rate})
    df = pd.DataFrame(rows, columns=COLUMNS)
    pre = pd.DataFrame([{"system": s, "prompt_len": prefill_len, "repeats": len(v),
                         "ttft_ms_p50": quantiles(v, 50)[0] * 1e3, "ttft_ms_p90": quantiles(v, 90)[0] * 1e3,
                         "prefill_tok_s": prefill_len / quantiles(v, 50)[0]} for s, v in ttft.items()],
                       columns=PREFILL_COLUMNS)
    h1 = df[df.system == "hf-transformers"].iloc[0]
    ratios: dict[str, float] = {"b1_target": TARGET_B1_RATIO, "b1_roof_target": TARGET_B1_ROOF,
                                "ttft_target": TARGET_TTFT_RATIO, "torch_threads": threads,
                                **roof,
                                # 1: the engine's weights and the probe's buffer on huge pages (engine/host_memory.py;
                                # HF's weights stay in torch's allocations, as HF runs them)
                                "host_huge_pages": float(why_not(get_envs().DEEPINFER_HOST_HUGE_PAGES) is None)}
    ratios |= {f"b{b}_batch_target": t for b, t in TARGET_BATCH_SPEEDUP.items()}

    def row(label: str, b: int) -> pd.Series:
        return df[(df.system == f"deepinfer[{label}]") & (df.batch_size == b)].iloc[0]

    for label in engines:
        e1 = row(label, 1)
        ratios[f"{label}:b1_ms_per_token_engine_over_hf"] = float(e1.ms_per_token_p50 / h1.ms_per_token_p50)
        ratios[f"{label}:b1_roof_fraction"] = float(e1.roof_fraction)
        for b in batches:
            ratios[f"{label}:b{b}_tok_s_over_b1"] = float(row(label, b).decode_tok_s / e1.decode_tok_s)
            # the same ratio were batch b to stream its weight bytes (each distinct expert once) at batch 1's GB/s
            ratios[f"{label}:b{b}_bytes_bound"] = float(
                b * e1.weight_bytes_per_step / row(label, b).weight_bytes_per_step)
            # the most it can be: batch b's multiply-adds at the GEMM probe's rate against batch 1's measured step
            ratios[f"{label}:b{b}_gemm_bound"] = float(
                b * e1.ms_per_step_p50 / 1e3 / (row(label, b).gemm_fmas_per_step / (rate * 1e9)))
        ratios[f"{label}:b1_ms_per_token_over_eager"] = float(
            e1.ms_per_token_p50 / row(graph_modes[0], 1).ms_per_token_p50)
    if len(pre) == 2:
        ratios["ttft_engine_over_hf"] = float(pre.ttft_ms_p50.iloc[0] / pre.ttft_ms_p50.iloc[1])
    return df, pre, ratios


def targets(ratios: dict[str, float], graph_modes: tuple[str, ...], batch: int | tuple[int, ...],
            prefill_len: int, kernels_also: tuple[str, ...] = ()) -> pd.DataFrame:
    """The run's ratios against their targets, one row per (engine, measure)."""
    batches = (batch,) if isinstance(batch, int) else tuple(batch)
    rows = []
    for label in [*graph_modes, *(f"{m},{k}" for m in graph_modes for k in kernels_also)]:
        b1 = ratios[f"{label}:b1_ms_per_token_engine_over_hf"]
        rows.append({"engine": label, "measure": "batch-1 ms/token, engine / HF", "value": b1,
                     "target": f"<= {ratios['b1_target']}", "met": b1 <= ratios["b1_target"]})
        roof = ratios.get(f"{label}:b1_roof_fraction")
        if roof is not None:
            rows.append({"engine": label, "measure": "batch-1 achieved GB/s / memory roof (stored bytes)",
                         "value": roof, "target": f">= {ratios['b1_roof_target']}",
                         "met": roof >= ratios["b1_roof_target"]})
        for b in batches:
            bk = ratios[f"{label}:b{b}_tok_s_over_b1"]
            want = ratios.get(f"b{b}_batch_target")
            rows.append({"engine": label, "measure": f"batch-{b} tok/s / batch-1 tok/s (engine)", "value": bk,
                         "target": f">= {want}" if want is not None else "-",
                         "met": bk >= want if want is not None else "-"})
            bound = ratios.get(f"{label}:b{b}_bytes_bound")
            if bound is not None:  # above it, batch b must read its bytes faster than batch 1 does
                rows.append({"engine": label, "measure": f"  the same at batch-1's GB/s ({b} x batch-1 bytes / "
                             f"batch-{b} bytes)", "value": bound, "target": "-", "met": "-"})
            bound = ratios.get(f"{label}:b{b}_gemm_bound")
            if bound is not None:  # no kernel gets above it: batch b's multiply-adds at the GEMM probe's rate
                rows.append({"engine": label, "measure": f"  the most it can be at the GEMM probe's rate ({b} x "
                             f"batch-1 step / batch-{b} multiply-adds at that rate)", "value": bound, "target": "-",
                             "met": "-"})
        if label != graph_modes[0]:
            v = ratios[f"{label}:b1_ms_per_token_over_eager"]
            rows.append({"engine": label, "measure": f"batch-1 ms/token, {label} / {graph_modes[0]}", "value": v,
                         "target": "<= 1", "met": v <= 1.0})
    if "ttft_engine_over_hf" in ratios:
        v = ratios["ttft_engine_over_hf"]
        rows.append({"engine": graph_modes[0], "measure": f"TTFT of {prefill_len} tokens, engine / HF",
                     "value": v, "target": f"<= {ratios['ttft_target']}", "met": v <= ratios["ttft_target"]})
    return pd.DataFrame(rows, columns=["engine", "measure", "value", "target", "met"])
