"""`deepinfer golden`: every golden prompt through the engine's serving path, against the independent HF reference
outputs in golden/ (golden/make_golden.py). Returns data; the CLI renders it.

The prompts go to an `LLMEngine` as requests (greedy, `ignore_eos`, `max_tokens` = the golden's length): the same
scheduler (queueing, chunked prefill, preemption under the configured limits), KV pool, sampler and rank-job path
(`engine.run_job`, cp ranks) that `deepinfer serve` and `bench matrix` use. The engine's `on_logits` hook records
the fp32 logits every token was sampled from; they are compared with the reference's.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from deepinfer_bench.bench.report import REPO_ROOT
from deepinfer_bench.errors import GoldenError
from engine.config import EngineConfig, ModelConfig, Workload

GOLDEN_DIR = REPO_ROOT / "golden"
MAGIC, FORMAT_VERSION = "deepinfer-golden", 1
REGENERATE = "pip install -e '.[reference]' && python golden/make_golden.py"
# fp32 must match the fp32 HF reference to ~1e-5; 1e-3 leaves room for summation order, nothing more.
FP32_LOGIT_TOL = 1e-3
# Any other dtype is judged three-way against the HF reference in fp32 and in that dtype
# (deepinfer_bench/bench/verdict.py): no fixed logit tolerance.

COLUMNS = ["prompt", "kind", "prompt_len", "tokens_matched", "tokens_total", "first_divergent_step",
           "max_abs_dlogit", "logit_tol", "verdict"]


@dataclass
class GoldenPrompt:
    name: str
    kind: str
    prompt_ids: list[int]
    output_ids: list[int]
    logits: torch.Tensor  # [N, vocab] fp32


@dataclass
class GoldenRun:
    table: pd.DataFrame
    meta: dict[str, Any]
    collectives: dict[str, int] = field(default_factory=dict)
    steps: int = 0
    kernels: pd.DataFrame = field(default_factory=lambda: pd.DataFrame(columns=KERNEL_COLUMNS))
    tokens: dict[str, pd.DataFrame] = field(default_factory=dict)  # three-way: per prompt, per token
    logits: dict[str, torch.Tensor] = field(default_factory=dict)  # the engine's, per prompt
    reference: Any = None  # three-way: the refcache.Reference
    per_layer: list[Any] = field(default_factory=list)  # PerLayer per --per-layer prompt

    @property
    def n_match(self) -> int:
        return int((self.table["verdict"] == "match").sum())

    @property
    def ok(self) -> bool:
        band = self.meta.get("band")  # three-way: the run-level test too
        return self.n_match == len(self.table) and (band is None or band["passed"])


def load_golden(golden_dir: Path, cfg: ModelConfig,
                check_model: bool = True) -> tuple[dict[str, Any], list[GoldenPrompt]]:
    """The golden's meta and prompts; `check_model`: the golden must have been made for `cfg` (its logits are
    compared). The three-way verdict takes only the golden's token sequences (its references are made for the
    model at hand: deepinfer_bench/bench/refcache.py), so any golden whose ids fit the vocabulary serves."""
    from safetensors.torch import load_file

    meta_path, data_path = golden_dir / "golden.json", golden_dir / "golden.safetensors"
    if not meta_path.exists() or not data_path.exists():
        raise GoldenError(f"no golden data in {golden_dir} (expected golden.json + golden.safetensors); "
                          f"regenerate with: {REGENERATE}")
    meta = json.loads(meta_path.read_text())
    if meta.get("magic") != MAGIC or meta.get("format_version") != FORMAT_VERSION:
        raise GoldenError(f"{meta_path}: format {meta.get('magic')!r} v{meta.get('format_version')}, this deepinfer "
                          f"reads {MAGIC!r} v{FORMAT_VERSION}; regenerate with: {REGENERATE}")
    if check_model and meta.get("config_hash") != cfg.config_hash() and not _same_main_model(meta, cfg):
        raise GoldenError(f"{meta_path} was made for config {meta.get('config_hash')}, the model's config is "
                          f"{cfg.config_hash()}; regenerate with: {REGENERATE}")
    tensors = load_file(str(data_path))
    if not check_model:
        big = [p["name"] for p in meta["prompts"] if max(p["prompt_ids"] + p["output_ids"]) >= cfg.vocab_size]
        if big:
            raise GoldenError(f"{meta_path}: token ids past the model's vocabulary ({cfg.vocab_size}) in {big}")
    prompts = [GoldenPrompt(name=p["name"], kind=p["kind"], prompt_ids=tensors[f"{p['name']}.prompt_ids"].tolist(),
                            output_ids=tensors[f"{p['name']}.output_ids"].tolist(),
                            logits=tensors[f"{p['name']}.logits"].float()) for p in meta["prompts"]]
    return meta, prompts


# The fields of a config that describe only its draft head (MTP blocks or DSpark stages): the reference goldens
# (HF, official generate.py) never run a draft head, so a golden of the main model holds for every draft head.
_DRAFT_FIELDS = ("n_mtp_layers", "dspark_block_size", "dspark_noise_token_id", "dspark_target_layer_ids",
                 "dspark_markov_rank")


def main_model_hash(cfg: ModelConfig) -> str:
    """The hash of the main-model part of a config: every field except the draft head's (and the draft layers'
    compress ratios)."""
    import dataclasses
    import hashlib

    d = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in _DRAFT_FIELDS}
    d["compress_ratios"] = list(cfg.compress_ratios[: cfg.n_layers])
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


def _same_main_model(meta: dict[str, Any], cfg: ModelConfig) -> bool:
    """The golden's model (its `model_dir`, whose config must hash to the golden's `config_hash`) and `cfg` differ
    only in their draft heads (golden/tiny-dspark against golden/tiny's golden)."""
    where = meta.get("model_dir")
    if not where or not (REPO_ROOT / where / "config.json").exists():
        return False
    made_for = ModelConfig.from_json(REPO_ROOT / where)
    return made_for.config_hash() == meta.get("config_hash") and main_model_hash(made_for) == main_model_hash(cfg)


def workload(prompts: list[GoldenPrompt]) -> Workload:
    """Every golden prompt at once: one slot each, the whole prefill in one step, a pool that holds them all
    (`deepinfer golden --max-num-seqs 3 ...` overrides any of these sizes)."""
    lens = tuple(len(p.prompt_ids) + len(p.output_ids) for p in prompts)
    return Workload(max_num_seqs=len(prompts), max_model_len=max(lens), pool=(lens,),
                    max_num_batched_tokens=sum(len(p.prompt_ids) for p in prompts),
                    max_input_len=max(len(p.prompt_ids) for p in prompts))


def default_dirs(numerics: Any = "hf", dtype: Any = "float32") -> tuple[Path, Path]:
    """(model dir, golden dir) `deepinfer golden` uses by default: the tiny model and the HF golden for hf numerics;
    for official numerics golden/tiny-official and the official code's own golden of the same dtype
    (golden/official: bf16, what inference/model.py runs; golden/official-fp32: the same code in fp32)."""
    if str(numerics) == "official":
        return GOLDEN_DIR / "tiny-official", GOLDEN_DIR / ("official-fp32" if str(dtype) == "float32" else "official")
    return GOLDEN_DIR / "tiny", GOLDEN_DIR


def golden_config(model_dir: str | Path | None = None, golden_dir: str | Path | None = None,
                  **overrides: Any) -> EngineConfig:
    """The engine config `deepinfer golden` runs: sized for the golden prompts, then `overrides` (flat EngineConfig
    names, e.g. max_num_seqs=3, graph_mode="layer", cp=2, numerics="official"); the model and golden default to
    `default_dirs` of the overrides' numerics and dtype."""
    dirs = default_dirs(overrides.get("numerics") or "hf", overrides.get("dtype") or "float32")
    model_dir = Path(model_dir or dirs[0])
    cfg = ModelConfig.from_json(model_dir)
    _, prompts = load_golden(Path(golden_dir or dirs[1]), cfg, check_model=False)  # sizes only: run_golden checks
    overrides.setdefault("speculative_policy", "always")  # a speculative golden checks every verify step
    return EngineConfig.from_model_config(cfg, model_dir=str(model_dir), workload=workload(prompts), **overrides)


class _StepCounters:
    """The backend's counters per decode step (engine/backends `Counters`, the same schema on every backend):
    compiles in decode steps whose graph shapes were all seen before ("after warm-up"; `compiles_after_warmup`:
    every compile - on xla also eager mode's per-op graphs; `graph_compiles_after_warmup`: the engine's graphs only),
    fallbacks in decode steps, device-to-host and host-to-device copies per decode step (to the device: the step's
    inputs, plus a freed slot's index)."""

    def __init__(self, engine: Any) -> None:
        self.engine, self.backend = engine, engine.runner.backend
        self.last = self.backend.counters()
        self.graphs = self._graphs()
        self.prefill = engine.stats().num_prefill_tokens
        self.decode_steps = self.after_warmup = self.graph_after_warmup = self.fallbacks = 0
        self.to_host = self.to_device = 0

    def _graphs(self) -> int:
        regions = getattr(self.engine.runner, "regions", None)
        return len(regions.compiled) if regions is not None else 0

    def __call__(self) -> None:
        now, graphs, prefill = self.backend.counters(), self._graphs(), self.engine.stats().num_prefill_tokens
        if prefill == self.prefill:  # a pure decode step
            d = now.minus(self.last)
            self.decode_steps += 1
            self.fallbacks += d["fallbacks"]
            self.to_host += d["transfers_to_host"]
            self.to_device += d["transfers_to_device"]
            if graphs == self.graphs:  # no new (region, bucket) shape: its graphs must all be cached
                self.after_warmup += d["compiles"]
                self.graph_after_warmup += d["graph_compiles"]
        self.last, self.graphs, self.prefill = now, graphs, prefill

    def summary(self) -> dict[str, Any]:
        n = max(1, self.decode_steps)
        return {**{k: v for k, v in self.last.to_dict().items() if k != "fallback_ops"},
                "decode_steps": self.decode_steps, "compiles_after_warmup": self.after_warmup,
                "graph_compiles_after_warmup": self.graph_after_warmup,
                "fallbacks_per_decode_step": self.fallbacks / n,
                "transfers_to_host_per_decode_step": self.to_host / n,
                "transfers_to_device_per_decode_step": self.to_device / n, "fallback_ops": self.last.fallback_ops}


KERNEL_COLUMNS = ["family", "dispatch_key", "executor", "calls"]


def kernel_dispatches(dispatcher: Any) -> list[dict[str, Any]]:
    """The kernel dispatches a runner's dispatcher counted (nki_kernels/dispatch.py), one row per (key, executor),
    plus the fallbacks to the reference traced into compiled graphs (executor "reference (in graph)")."""
    from nki_kernels.dispatch import IN_GRAPH_FALLBACKS

    return [{"family": key.split(".")[0], "dispatch_key": key, "executor": ex, "calls": n}
            for (key, ex), n in sorted(dispatcher.counts_of().items())] + \
        [{"family": name, "dispatch_key": f"{name}.fallback:{why}", "executor": "reference (in graph)", "calls": n}
         for (name, why), n in sorted(IN_GRAPH_FALLBACKS.items())]


def forced_with_logits(engine: Any, prompts: list[list[int]], forced: list[list[int]],
                       on_step: Callable[[], None] | None = None,
                       finals: list[Any] | None = None) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Teacher forcing through the engine's serving loop (`engine.llm.drive_with_logits` with `forced`): per prompt
    the forced ids and the fp32 logits [n, vocab] the engine computed for each of them (the engine's own pick is
    their argmax). Up to the first step where that argmax differs it is the free-running greedy run."""
    from engine.llm import drive_with_logits

    return drive_with_logits(engine, prompts, forced=forced, on_step=on_step, finals=finals)


def capture_layers(engine: Any, prompt_ids: list[int], forced: list[int]) -> dict[str, torch.Tensor]:
    """One prompt alone through the engine's serving loop, teacher-forced, capturing the residual streams after
    every layer's attention half ("attn") and MoE half ("ffn") at every position: {module: fp32 [layers,
    positions, hc, dim]}, and the KV state at the end ("kv_window.L", "kv_entries.L", "kv_index.L": as
    hf_reference.hf_kv_state). The layers run as their two halves (the fused native layer computes bit for bit
    the halves one by one: engine/model/block.py), so both halves are seen at decode positions too."""
    from engine.llm import drive_with_logits

    model = engine.runner.model
    grabbed: dict[str, dict[int, list[torch.Tensor]]] = {m: {} for m in ("attn", "ffn")}
    entries: dict[str, dict[int, dict[int, torch.Tensor]]] = {"kv_entries": {}, "kv_index": {}}  # layer -> id -> row

    def store(fn: Callable[..., None], kind: str, layer: int) -> Callable[..., None]:
        def run(e: torch.Tensor, w: torch.Tensor, *args: Any) -> None:
            fn(e, w, *args)
            for i, v in zip(w.tolist(), e, strict=True):
                entries[kind].setdefault(layer, {})[i] = v.detach().float().clone()
        return run

    rings: dict[int, torch.Tensor] = {}  # layer -> its window ring after the latest step

    def wrap(fn: Callable[..., torch.Tensor], module: str, layer: int) -> Callable[..., torch.Tensor]:
        def run(*args: Any) -> torch.Tensor:
            y = fn(*args)
            grabbed[module].setdefault(layer, []).append(y.detach().float().clone())
            if module == "attn":
                x, plan, cache = args
                rings[layer] = cache.layers[layer].win_store[plan.seqs[0].slot].float().clone()
            return y
        return run

    def eager_attn(blk: Any) -> Callable[..., torch.Tensor]:
        """The attention half as modules (the eager path: every compressor store goes through `_store`)."""
        return lambda x, plan, cache: blk.hc_site(x, "attn", lambda h: blk.attn(h, plan, cache.layers[blk.layer_id]))

    for blk in model.layers:
        blk.attn_half = wrap(eager_attn(blk), "attn", blk.layer_id)
        blk.ffn_half = wrap(blk.ffn_half, "ffn", blk.layer_id)
        # the two halves, never the fused native layer (ops.block_decoder.layer), which would hide them
        blk.forward = lambda x, plan, cache, ids, b=blk: b.ffn_half(b.attn_half(x, plan, cache), plan, ids)
        if blk.attn.compressor is not None:
            blk.attn.compressor._store = store(blk.attn.compressor._store, "kv_entries", blk.layer_id)
        if blk.attn.indexer is not None:
            blk.attn.indexer.compressor._store = store(blk.attn.indexer.compressor._store, "kv_index", blk.layer_id)
    try:
        drive_with_logits(engine, [prompt_ids], forced=[forced])
    finally:
        for blk in model.layers:
            for name in ("attn_half", "ffn_half", "forward"):
                blk.__dict__.pop(name, None)
            for comp in (blk.attn.compressor, getattr(blk.attn.indexer, "compressor", None)):
                if comp is not None:
                    comp.__dict__.pop("_store", None)
    want = len(prompt_ids) + len(forced) - 1
    out = {}
    for module, per in grabbed.items():
        steps = [torch.cat(per[i]) if per.get(i) else None for i in range(len(model.layers))]
        if any(s is None or s.shape[0] != want for s in steps):
            got = [0 if s is None else s.shape[0] for s in steps]
            raise GoldenError(f"--per-layer captured {got} positions per layer, expected {want}: the capture needs "
                              f"the layers run eagerly as modules, one sequence at a time, no preemption (this "
                              f"backend / graph mode compiles them away?)")
        out[module] = torch.stack(steps)
    # the KV state at the end, as the reference's cache holds it: the window of the last window - 1 positions (ring
    # row = position mod ring rows, read after the last step), every compressed entry and indexer key by id (as the
    # compressors stored them)
    for lid, ring in rings.items():
        keep = torch.arange(max(0, want - model.cfg.window_size + 1), want)
        out[f"kv_window.{lid}"] = ring[keep % ring.shape[0]].clone()
    for kind, per in entries.items():
        for layer, ids in per.items():
            out[f"{kind}.{layer}"] = torch.stack([ids[i] for i in sorted(ids)])
    return out


def _golden_job(engine: Any, prompts: list[list[int]], max_new: list[int], progress: bool,
                forced: list[list[int]] | None = None,
                per_layer: list[tuple[list[int], list[int]]] = ()) -> dict[str, Any]:
    """On rank 0: every prompt as a greedy request, with the logits each token was sampled from (`progress`: a bar
    of generated tokens on stderr); with `forced`, teacher-forced on those tokens (`forced_with_logits`); then each
    (prompt, forced) of `per_layer` alone, its layers captured (`capture_layers`)."""
    from engine.llm import drive_with_logits
    from engine.stack import blas_mode
    counters = _StepCounters(engine)
    engine.runner.dispatcher.reset()
    with _token_bar(progress, len(prompts), sum(max_new)) as advance:
        def on_step() -> None:
            counters()
            advance(engine.stats().num_generated_tokens)

        finals: list[Any] = []
        outs, logits = drive_with_logits(engine, prompts, max_new, forced=forced, on_step=on_step, finals=finals)
    runner, stats = engine.runner, engine.stats()
    regions = getattr(runner, "regions", None)
    res = {"outs": outs, "logits": logits, "collectives": runner.par.report(), "steps": stats.num_steps,
           "preemptions": stats.num_preemptions, "graph_mode": str(runner.graph_mode),
           "region_launches": regions.launches if regions is not None else 0,
           "distinct_graphs": len(regions.compiled) if regions is not None else 0, "backend": counters.summary(),
           "kernels": kernel_dispatches(runner.dispatcher), "weights": _weight_summary(runner),
           "host_math": blas_mode(), "speculative": engine.spec_stats.to_dict(),
           "drafts": [(f.num_draft_tokens, f.num_accepted_tokens) for f in finals],
           "device_peak": device_peak(runner.backend)}
    res["layers"] = [capture_layers(engine, p, f) for p, f in per_layer]  # after the counters: not counted there
    return res


def device_peak(backend: Any) -> int | str:
    """Rank 0's device peak memory in bytes (the backend's `device_peak`, as its SDK exposes it), or why it is not
    measured: a backend without a device memory has no such number (never reported as 0)."""
    from engine.backends.torchneuron import NOT_MEASURED

    peak = getattr(backend, "device_peak", None)
    return peak() if peak is not None else NOT_MEASURED


def device_peak_meta(peak: int | str) -> dict[str, Any]:
    """Results metadata of a device peak: `device_peak_bytes` (None when not measured) and `device_peak` (the bytes,
    or the reason)."""
    return {"device_peak_bytes": peak if isinstance(peak, int) else None, "device_peak": peak}


@contextlib.contextmanager
def _token_bar(show: bool, prompts: int, total: int) -> Iterator[Callable[[int], None]]:
    """A progress bar of generated tokens on stderr (gone when done on a terminal); a no-op when not `show`."""
    if not show:
        yield lambda done: None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from deepinfer_bench.bench.report import err_console

    with Progress(TextColumn(f"golden: {prompts} prompts, tokens"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=err_console, transient=True) as bar:
        task = bar.add_task("tokens", total=total)
        yield lambda done: bar.update(task, completed=done)


def _weight_summary(runner: Any) -> dict[str, Any]:
    from engine.model.model import formats_of

    model, placed = runner.model, runner.weights_memory
    formats = formats_of(model)
    return {"resident_weight_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
            "stored_fp8": sum(f == "fp8" for f in formats.values()),
            "stored_fp4": sum(f == "fp4" for f in formats.values()),
            "memory": placed.as_dict() if placed is not None else "device"}  # host: huge pages or why not


def compare(g: GoldenPrompt, out: list[int], logits: torch.Tensor, dtype: str = "float32") -> dict[str, Any]:
    """An fp32 greedy run against the fp32 golden: tokens identical, logits within FP32_LOGIT_TOL up to and
    including the first divergent step."""
    n = len(g.output_ids)
    out, logits = out[:n], logits[:n]
    diverge = next((i for i, (a, b) in enumerate(zip(out, g.output_ids, strict=True)) if a != b), None)
    upto = n if diverge is None else diverge + 1  # logits are comparable up to and including the divergent step
    dlogit = float((logits[:upto] - g.logits[:upto]).abs().max())
    matched = sum(a == b for a, b in zip(out, g.output_ids, strict=True))
    verdict = "match" if diverge is None and dlogit <= FP32_LOGIT_TOL else "mismatch"
    return {"prompt": g.name, "kind": g.kind, "prompt_len": len(g.prompt_ids), "tokens_matched": matched,
            "tokens_total": n, "first_divergent_step": -1 if diverge is None else diverge,
            "max_abs_dlogit": dlogit, "logit_tol": FP32_LOGIT_TOL, "verdict": verdict}


@dataclass(frozen=True)
class OfficialTol:
    """Teacher-forced bounds for --numerics official: top-1 agreement over every step of every prompt
    (`min_top1`), per prompt (`min_prompt_top1`), and the largest |dlogit| of any step of a prompt
    (`max_dlogit`)."""

    min_top1: float
    min_prompt_top1: float
    max_dlogit: float


# --numerics official against the official code's own goldens (golden/README.md "The official golden"). Exact greedy
# agreement cannot be required there: the official numerics are discontinuous (an element crossing an e4m3 / e2m1
# rounding boundary, a block amax crossing a power of two, an index score crossing the top-k boundary), so any other
# summation order moves some values across such a boundary. The check is teacher-forced (the engine scores the
# golden's own tokens: `forced_with_logits`) and statistical, with bounds below floors measured on the official code
# itself run as another valid implementation would run it (scripts/official_floors.py, 456 steps; the engine's own
# numbers from `deepinfer golden --numerics official [--dtype bfloat16]`, 2026-12-03):
# * float32 (golden/official-fp32, the default): the official code with GEMMs + attention summed in fp64 instead of
#   fp32 reaches 446/456 = 97.8 % top-1, worst prompt 43/48, max |dlogit| 2.58; the engine's reference
#   table (the golden's own torch ops) 454/456, max 2.0; the host and stand-in tables, whose ops agree with the
#   reference's to 2e-6 on the same inputs (fp32 summation order only), 434/456 = 95.2 %, worst prompt 37/48,
#   max 4.46: in a chaotic tiny model fp32 noise alone sends a prompt across a rounding boundary now and then, and
#   max |dlogit| then says nothing (hf numerics: 4.48). Top-1 discriminates: hf numerics score 375/456 = 82.2 %,
#   one simulation step left out ~85-89 % (golden/README.md cross-check).
# * bfloat16 (golden/official): the golden was made on a CPU, where torch's bf16 rsqrt (the per-head q norm) rounds
#   twice - bf16(1 / bf16(sqrt x)) - for the elements past the last 32-wide vector chunk (every element of a decode
#   step), while a GPU rounds once. The official code with a once-rounded rsqrt and fp64 sums (what the engine
#   computes: engine/model/numerics.py "Exact accumulation") lands at 372/456 = 81.6 % top-1, worst prompt 19/32,
#   max |dlogit| 5.07; the engine 375/456 = 82.2 %, max 4.99. The README's 95.8 % floor kept the CPU's double
#   rounding, which no implementation that rounds once can reach. NOT discriminating on this tiny model: hf numerics
#   in bf16 score 366/456 = 80.3 % (max 5.13) - bf16 rounding chaos dominates; the float32 check is the one that
#   tells official numerics from hf.
OFFICIAL_TOL = {"bfloat16": OfficialTol(min_top1=0.75, min_prompt_top1=0.5, max_dlogit=6.0),
                "float32": OfficialTol(min_top1=0.93, min_prompt_top1=0.7, max_dlogit=6.0)}


def check_official_golden(meta: dict[str, Any], dtype: str, golden_dir: Path) -> None:
    """--numerics official compares against a golden of the official code in the same dtype (bf16: golden/official,
    fp32: golden/official-fp32); anything else is one line."""
    want = {"bfloat16": "official", "float32": "official-sim-fp32"}[dtype]
    have = meta.get("numerics")
    if have != want:
        hint = {"official": "golden/official (--dtype bfloat16)",
                "official-sim-fp32": "golden/official-fp32 (--dtype float32)"}
        raise GoldenError(f"{golden_dir} holds {have or 'HF'} numerics, --numerics official --dtype {dtype} compares "
                          f"against the official code's {dtype} run: {hint[want]}")


def compare_official(runs: list[tuple[GoldenPrompt, torch.Tensor]], dtype: str) -> list[dict[str, Any]]:
    """Rows of a teacher-forced run (`forced_with_logits`) against an official golden: `tokens_matched` = steps whose
    argmax is the golden's token (top-1 agreement), `first_divergent_step` = the first that is not (where a free
    greedy run would leave the golden), `max_abs_dlogit` over every step; verdict by OFFICIAL_TOL[dtype], and every
    row "mismatch" when the agreement over all prompts is under `min_top1`."""
    tol = OFFICIAL_TOL[dtype]
    rows, agree, total = [], 0, 0
    for g, logits in runs:
        n = len(g.output_ids)
        hit = logits[:n].argmax(-1) == torch.tensor(g.output_ids)
        miss = (~hit).nonzero()
        dlogit = float((logits[:n] - g.logits[:n]).abs().max())
        top1 = int(hit.sum())
        agree, total = agree + top1, total + n
        ok = top1 >= tol.min_prompt_top1 * n and dlogit <= tol.max_dlogit
        rows.append({"prompt": g.name, "kind": g.kind, "prompt_len": len(g.prompt_ids), "tokens_matched": top1,
                     "tokens_total": n, "first_divergent_step": int(miss[0]) if len(miss) else -1,
                     "max_abs_dlogit": dlogit, "logit_tol": tol.max_dlogit, "verdict": "match" if ok else "mismatch"})
    if agree < tol.min_top1 * total:
        for r in rows:
            r["verdict"] = "mismatch"
    return rows


def three_way(numerics: Any, dtype: Any) -> bool:
    """Whether a run is judged by the three-way verdict (deepinfer_bench/bench/verdict.py): hf numerics in any dtype but
    fp32 (fp32 keeps its exact check; official numerics compare with the official code's own goldens)."""
    return str(numerics or "hf") != "official" and str(dtype or "float32") != "float32"


@dataclass
class PerLayer:
    """`--per-layer`: the layer x module x position-bucket table, every position's row, the first divergence
    (None: every position inside the noise band) and the prompt it was captured on."""

    prompt: str
    table: pd.DataFrame
    positions: pd.DataFrame
    first: dict[str, Any] | None
    kv: pd.DataFrame = field(default_factory=pd.DataFrame)  # the KV state per (layer, kind): verdict.kv_rows


def run_golden(config: EngineConfig, golden_dir: str | Path | None = None, progress: bool = False,
               reference_dir: str | Path | None = None, per_layer: list[str] = ()) -> GoldenRun:
    """Every golden prompt through an engine built from `config` (on its cp ranks); one row per prompt. fp32: the
    config's model must be the one the golden was made for (checked by config hash), tokens and logits exact.
    Any other dtype (hf numerics): teacher-forced on the golden's tokens and judged by the three-way verdict against
    the HF reference of this model in fp32 and in the run's dtype (refcache: read from `reference_dir` / the
    default cache, made when absent); `per_layer`: prompt names whose every layer is captured and compared too.
    `progress`: a bar of the generated tokens on stderr while it runs."""
    golden_dir = Path(golden_dir or GOLDEN_DIR)
    cfg = config.model.config
    dtype = str(config.model.dtype)
    official = str(config.model.numerics) == "official"
    threeway = three_way(config.model.numerics, dtype)
    exact_ref = not official and not threeway and reference_dir is not None  # fp32 against the given reference
    meta, prompts = load_golden(golden_dir, cfg, check_model=not (threeway or exact_ref))
    from engine import run_job
    from engine.backends import measured_on

    if official:
        check_official_golden(meta, dtype, golden_dir)
    elif meta.get("numerics"):
        raise GoldenError(f"{golden_dir} holds the official code's numerics ({meta['numerics']}): compare with "
                          f"--numerics official")
    if (official or threeway) and config.spec.enabled:  # verify steps accept by the target's own argmax
        raise GoldenError(f"--dtype {dtype}{' --numerics official' if official else ''} compares teacher-forced, one "
                          f"token per step: run it without --speculative")
    names = [p.name for p in prompts]
    unknown = [n for n in per_layer if n not in names]
    if unknown:
        raise GoldenError(f"--per-layer prompt(s) {unknown} not in the golden; it has {names}")
    if per_layer and official:
        raise GoldenError("--per-layer compares with the HF reference: run it with --numerics hf")
    if per_layer and config.cp > 1:
        raise GoldenError("--per-layer captures one rank's layers: run it with --cp 1")
    ref = None
    if threeway or per_layer or exact_ref:
        from deepinfer_bench.bench.refcache import Sequence, get_reference

        if config.model.model_dir is None:
            raise GoldenError("the three-way verdict needs the model's directory (its reference is made from it)")
        seqs = [Sequence(p.name, p.prompt_ids, p.output_ids) for p in prompts]
        ref = get_reference(config.model.model_dir, cfg, seqs, per_layer=list(per_layer), cache_dir=reference_dir)
    forced = [p.output_ids for p in prompts] if (official or threeway or exact_ref) else None
    chosen = [p for p in prompts if p.name in per_layer]
    res = run_job(config, _golden_job, ([p.prompt_ids for p in prompts], [len(p.output_ids) for p in prompts],
                                        progress, forced, [(p.prompt_ids, p.output_ids) for p in chosen]))
    tokens: dict[str, pd.DataFrame] = {}
    band = None  # three-way: verdict.run_verdict's run-level numbers
    if official:
        rows = compare_official([(p, lg) for p, lg in zip(prompts, res["logits"], strict=True)], dtype)
    elif threeway:
        from deepinfer_bench.bench.verdict import run_verdict

        rows = []
        for p, lg in zip(prompts, res["logits"], strict=True):
            row, tokens[p.name] = compare_three_way(p, lg, ref.logits["float32"][p.name], ref.draws(dtype, p.name))
            rows.append(row)
        band = run_verdict(rows)
    elif exact_ref:
        rows = [compare_exact(p, lg, ref.logits["float32"][p.name]) for p, lg in zip(prompts, res["logits"],
                                                                                  strict=True)]
    else:
        rows = [compare(p, o, lg, dtype) for p, o, lg in zip(prompts, res["outs"], res["logits"], strict=True)]
    if config.spec.enabled:  # per prompt: the drafts its verify steps carried, and the share the target accepted
        for row, (drafted, accepted) in zip(rows, res["drafts"], strict=True):
            row["drafted"], row["acceptance_rate"] = drafted, accepted / drafted if drafted else float("nan")
    comparison = ("teacher-forced, statistical (OFFICIAL_TOL)" if official else
                  "teacher-forced, exact against the reference's fp32 logits" if exact_ref else
                  "teacher-forced, three-way (deepinfer_bench/bench/verdict.py)" if threeway else "greedy, per token")
    run_meta = {"golden_dir": str(golden_dir), "engine_config": config.to_dict(),
                "golden": {k: meta.get(k) for k in ("seed", "torch_version", "transformers_version", "reference",
                                                    "numerics")},
                "comparison": comparison, "reference_key": ref.key if ref is not None else None,
                "band": band,
                "engine_steps": res["steps"], "preemptions": res["preemptions"], "graph_mode": res["graph_mode"],
                "region_launches": res["region_launches"], "distinct_graphs": res["distinct_graphs"],
                "backend": res["backend"], "weights": res["weights"], "collectives": res["collectives"],
                "host_math": res["host_math"], "measured_on": measured_on(config.backend),
                "speculative": None, **device_peak_meta(res["device_peak"])}
    if config.spec.enabled:
        run_meta["speculative"] = {"method": str(config.spec.method),
                                   "num_speculative_tokens": config.spec.num_speculative_tokens, **res["speculative"]}
    for row in rows:
        row.pop("kld_draws", None)
    columns = (THREE_WAY_COLUMNS if threeway else COLUMNS) + (["drafted", "acceptance_rate"] if config.spec.enabled
                                                              else [])
    run = GoldenRun(table=pd.DataFrame(rows, columns=columns), meta=run_meta, collectives=res["collectives"],
                    steps=res["steps"], kernels=pd.DataFrame(res["kernels"], columns=KERNEL_COLUMNS))
    run.tokens = tokens
    run.logits = {p.name: lg for p, lg in zip(prompts, res["logits"], strict=True)}
    run.reference = ref
    run.per_layer = [_per_layer(p.name, caps, ref, dtype, cfg) for p, caps in zip(chosen, res["layers"], strict=True)]
    return run


def _per_layer(name: str, caps: dict[str, torch.Tensor], ref: Any, dtype: str, cfg: ModelConfig) -> PerLayer:
    from deepinfer_bench.bench.verdict import first_divergence, kv_rows, layer_table, position_rows

    exact = FP32_LOGIT_TOL if dtype == "float32" else None  # fp32: the exact check's room for summation order
    rows = position_rows(caps, ref.layers[dtype][name], ref.layers["float32"][name], exact_tol=exact)
    ratios = list(cfg.compress_ratios[: cfg.n_layers])
    kv = kv_rows(caps, ref.layers[dtype][name], ref.layers["float32"][name], exact_tol=exact)
    return PerLayer(prompt=name, table=pd.DataFrame(layer_table(rows, ratios)), positions=pd.DataFrame(rows),
                    first=first_divergence(rows), kv=pd.DataFrame(kv))


def compare_exact(g: GoldenPrompt, logits: torch.Tensor, fp32: torch.Tensor) -> dict[str, Any]:
    """An fp32 teacher-forced run against the reference's fp32 logits (a model without a committed golden, e.g. a
    slice, given `--reference`): every step's argmax the reference's and logits within FP32_LOGIT_TOL."""
    n = len(fp32)
    hit = logits[:n].argmax(-1) == fp32.argmax(-1)
    miss = (~hit).nonzero()
    dlogit = float((logits[:n] - fp32).abs().max())
    ok = bool(hit.all()) and dlogit <= FP32_LOGIT_TOL
    return {"prompt": g.name, "kind": g.kind, "prompt_len": len(g.prompt_ids), "tokens_matched": int(hit.sum()),
            "tokens_total": n, "first_divergent_step": int(miss[0]) if len(miss) else -1, "max_abs_dlogit": dlogit,
            "logit_tol": FP32_LOGIT_TOL, "verdict": "match" if ok else "mismatch"}


THREE_WAY_COLUMNS = ["prompt", "kind", "prompt_len", "tokens_matched", "tokens_total", "first_divergent_step",
                     "kld_mean", "kld_draws_max", "outlier_z", "kld_expected_mean", "kld_ratio", "sigma_ratio_pooled",
                     "bhattacharyya_pooled",
                     "kld_p99", "kld_max", "tokens_passed", "first_failing_step", "worst_step", "sigma_ratio_median",
                     "sigma_ratio_max", "max_abs_dlogit", "logit_tol", "verdict"]


def compare_three_way(g: GoldenPrompt, logits: torch.Tensor, fp32: torch.Tensor,
                      draws: list[torch.Tensor]) -> tuple[dict[str, Any], pd.DataFrame]:
    """One prompt's teacher-forced logits against the reference in fp32 and its draws in the run's dtype (the first:
    the per-token table's expected run): (its row: `tokens_matched` = top-1 agreement with fp32,
    `first_divergent_step` = first step whose argmax is not fp32's, the verdict.py summary - its verdict is
    verdict.run_verdict's, over the run; its per-token table)."""
    from deepinfer_bench.bench.verdict import TOKEN_COLUMNS, kld, prompt_summary, token_table

    toks = token_table(logits, draws[0], fp32)
    n = len(toks)
    s = prompt_summary(toks, [kld(fp32[:n], d[:n]) for d in draws])
    miss = [t["step"] for t in toks if not t["top1"]]
    row = {"prompt": g.name, "kind": g.kind, "prompt_len": len(g.prompt_ids), "tokens_matched": s["top1"],
           "first_divergent_step": miss[0] if miss else -1, "logit_tol": float("nan"),
           **{k: v for k, v in s.items() if k != "top1"}}
    return row, pd.DataFrame(toks, columns=TOKEN_COLUMNS)


def collectives_per_layer(coll: dict[str, int], steps: int) -> pd.DataFrame:
    """Collective calls per layer per engine step, one column per site (e.g. moe.exchange:all_gather)."""
    rows: dict[str, dict[str, float]] = {}
    for key, count in coll.items():
        layer, site = key.split(".", 1)
        rows.setdefault(layer, {"layer": int(layer[1:])})[site] = count / max(1, steps)
    df = pd.DataFrame(sorted(rows.values(), key=lambda r: r["layer"]))
    return df.fillna(0.0)

