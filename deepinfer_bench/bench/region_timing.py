"""`deepinfer regions`: decode steps through the region graphs, timed per region and stage. Returns DataFrames
(no printing); the command renders and saves them (deepinfer_bench/cli/cmd_regions.py).

One run: build an engine (graph mode, timing, host compiler), queue `batch` greedy requests of `context` random
tokens and drive them with the engine's own step (deepinfer_bench/bench/batch_run.py: prefill, then decode steps), run
`warmup` decode steps (compiles every region for the shapes that follow), reset the timer, then time `steps` decode
steps: the wall time of each engine step (the measured step time: scheduler, runner, sampler) and, with timing on,
every (region, stage, layer) between split() boundaries; with timing on and the host kernel table, also every native
call (engine/host_kernels/clock.py: calls and ms per step of each `dk_*` entry point, and the rest of the step
outside them: Python, torch ops, the scheduler and sampler). Under `cp > 1` every rank runs the same steps (SPMD);
rank 0's numbers are returned.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from deepinfer_bench.bench.batch_run import random_prompts, run_batch
from engine.config import Workload
from engine.profiling import TIMING_COLUMNS, quantiles

STAGE_COLUMNS = ["graph_mode", "region", "stage", "layer", "calls", "calls_per_step", "total_ms", "p50_ms", "p90_ms",
                 "ms_per_step", "share_of_step"]
SUMMED_COLUMNS = ["graph_mode", "region", "stage", "layers", "calls_per_step", "ms_per_step", "p50_ms_sum",
                  "p90_ms_sum", "share_of_step"]
SUMMARY_COLUMNS = ["backend", "graph_mode", "host_compiler", "timing", "batch_size", "context_len", "cp", "steps",
                   "graph_launches_per_step", "distinct_graphs", "compiles_during_timing", "step_ms_p50",
                   "step_ms_p90", "step_ms_mean", "stage_sum_ms_per_step", "stage_sum_over_step", "timed_regions",
                   "xla_compiles_per_step", "xla_executions_per_step", "d2h_per_step", "h2d_per_step",
                   "fallbacks_per_step"]
NATIVE_COLUMNS = ["kernel", "calls_per_step", "ms_per_step", "share_of_step"]
OVERHEAD_COLUMNS = ["variant", "rounds", "steps_per_round", "step_ms_median", "step_ms_p10", "step_ms_p90",
                    "vs_no_timer", "p10_vs_no_timer"]


@dataclass(frozen=True)
class RegionsSpec:
    """The workload (the engine itself - graph mode, timing, cp, dtype, compiler - is the EngineConfig)."""

    batch: int = 4
    context: int = 64
    steps: int = 20
    warmup: int = 3
    seed: int = 0

    @property
    def max_len(self) -> int:
        """Context a run needs: prefill, warm-up, and the longer of the timed steps and an --overhead run."""
        return self.context + self.warmup + max(self.steps, OVERHEAD_ROUND_STEPS * 3 + 3) + 2


OVERHEAD_ROUND_STEPS = 20


def workload(spec: RegionsSpec) -> Workload:
    """One slot per sequence of the batch, the context it needs, the whole prefill in one step."""
    return Workload(max_num_seqs=spec.batch, max_model_len=spec.max_len, pool=((spec.max_len,) * spec.batch,),
                    max_num_batched_tokens=max(512, spec.batch * spec.context))


@dataclass
class RegionsResult:
    per_layer: pd.DataFrame
    summed: pd.DataFrame
    summary: pd.DataFrame
    meta: dict[str, Any] = field(default_factory=dict)
    native: pd.DataFrame = field(default_factory=lambda: pd.DataFrame(columns=NATIVE_COLUMNS))  # host kernels


def _prompts(engine: Any, spec: RegionsSpec, round_: int = 0) -> list[list[int]]:
    return random_prompts(engine.vocab_size, spec.batch, spec.context, f"{spec.seed}-{round_}")


def _regions_job(engine: Any, spec: RegionsSpec) -> dict[str, Any]:
    """On rank 0 (the others execute its steps): prefill, warm up, reset the timer, time `spec.steps` steps."""
    from engine.regions import region_summary

    torch.manual_seed(spec.seed)
    runner = engine.runner
    state: dict[str, Any] = {"decode": 0, "step_ms": [], "native": []}
    clock = None
    if engine.config.graph.region_timing and str(engine.config.kernels) == "host":
        from engine import host_kernels
        from engine.host_kernels.clock import NativeClock

        clock = NativeClock(host_kernels.ensure_loaded())

    def on_step(index: int, seconds: float, decoding: bool) -> None:
        if not decoding:
            return
        state["decode"] += 1
        if spec.warmup < state["decode"] <= spec.warmup + spec.steps:
            state["step_ms"].append(seconds * 1e3)
        if state["decode"] == spec.warmup:  # warmed up: what follows is measured
            runner.timer.reset()
            state["shapes"] = len(runner.regions.compiled) if runner.regions is not None else 0
            state["before"] = runner.backend.counters()
            if clock is not None:
                clock.install()
        if state["decode"] == spec.warmup + spec.steps:  # measured; the step after it (sequences finish) is not
            state["after"], state["timing"] = runner.backend.counters(), [asdict(r) for r in runner.timer.rows()]
            if clock is not None:
                clock.remove()
                state["native"] = clock.rows()

    # one decode step more than measured: the last one frees the slots (a copy of each finished slot's index)
    try:
        run_batch(engine, _prompts(engine, spec), spec.warmup + spec.steps + 2, on_step=on_step)
    finally:
        if clock is not None:
            clock.remove()
    after = state["after"]
    graph = region_summary(runner)
    graph["compiles_during_timing"] = graph.get("compiled_shapes", 0) - state["shapes"]  # a new block bucket
    graph["device"] = after.device
    n = len(state["step_ms"])
    graph["per_step"] = {k: v / n for k, v in after.minus(state["before"]).items()}
    graph["fallback_ops"] = after.fallback_ops
    return {"step_ms": state["step_ms"], "timing": state["timing"], "graph": graph,
            "collectives": runner.par.report(), "native": state["native"]}


def run_regions(config: Any, spec: RegionsSpec, threads: int | None = None) -> RegionsResult:
    """Time `spec.steps` decode steps of an engine built from `config`; per-layer and layer-summed stage tables
    plus a one-row summary."""
    from engine import run_job

    out = run_job(config, _regions_job, (spec,), threads=threads)
    return tabulate(config, spec, out["step_ms"], out["timing"], out["graph"], out["collectives"], out["native"])


def native_table(native: list[dict[str, Any]], steps: int, step_mean: float) -> pd.DataFrame:
    """Per native entry point (`NativeClock.rows()`): calls and ms per step, share of the mean step; then the rest
    of the step outside them ("(outside the native calls)": Python, torch ops, scheduler, sampler). Empty without
    rows."""
    if not native:
        return pd.DataFrame(columns=NATIVE_COLUMNS)
    rows = [{"kernel": r["kernel"], "calls_per_step": r["calls"] / steps, "ms_per_step": r["total_ms"] / steps}
            for r in native]
    rows.append({"kernel": "(outside the native calls)", "calls_per_step": float("nan"),
                 "ms_per_step": step_mean - sum(r["ms_per_step"] for r in rows)})
    df = pd.DataFrame(rows)
    df["share_of_step"] = df["ms_per_step"] / step_mean
    return df[NATIVE_COLUMNS]


def tabulate(config: Any, spec: RegionsSpec, step_ms: list[float], timing: list[dict[str, Any]],
             graph: dict[str, Any], collectives: dict[str, int] | None = None,
             native: list[dict[str, Any]] | None = None) -> RegionsResult:
    mode = str(config.graph.mode)
    n = len(step_ms)
    step_mean = statistics.fmean(step_ms)
    t = pd.DataFrame(timing, columns=TIMING_COLUMNS)
    t.insert(0, "graph_mode", mode)
    t["calls_per_step"] = t["calls"] / n
    t["ms_per_step"] = t["total_ms"] / n
    t["share_of_step"] = t["ms_per_step"] / step_mean
    per_layer = t[STAGE_COLUMNS].reset_index(drop=True)
    summed = (t.groupby(["graph_mode", "region", "stage"], sort=False)
              .agg(layers=("layer", "nunique"), calls_per_step=("calls_per_step", "sum"),
                   ms_per_step=("ms_per_step", "sum"), p50_ms_sum=("p50_ms", "sum"), p90_ms_sum=("p90_ms", "sum"),
                   share_of_step=("share_of_step", "sum"))
              .reset_index())[SUMMED_COLUMNS]
    stage_sum = float(t["ms_per_step"].sum()) if len(t) else float("nan")
    per_step = graph.get("per_step", {})
    nan = float("nan")
    summary = pd.DataFrame([{
        "backend": str(config.backend), "graph_mode": mode, "host_compiler": graph.get("graph_backend", "-"),
        "timing": config.graph.region_timing,
        "batch_size": spec.batch, "context_len": spec.context, "cp": config.cp, "steps": n,
        "graph_launches_per_step": graph.get("graph_launches_per_step", 0),
        "distinct_graphs": graph.get("distinct_graphs", 0),
        "compiles_during_timing": graph.get("compiles_during_timing", 0),
        "step_ms_p50": quantiles(step_ms, 50)[0], "step_ms_p90": quantiles(step_ms, 90)[0], "step_ms_mean": step_mean,
        "stage_sum_ms_per_step": stage_sum, "stage_sum_over_step": stage_sum / step_mean,
        "timed_regions": int(t["region"].nunique()) if len(t) else 0,
        "xla_compiles_per_step": per_step.get("compiles", nan),
        "xla_executions_per_step": per_step.get("executions", nan),
        "d2h_per_step": per_step.get("transfers_to_host", nan),
        "h2d_per_step": per_step.get("transfers_to_device", nan),
        "fallbacks_per_step": per_step.get("fallbacks", nan)}], columns=SUMMARY_COLUMNS)
    meta = {"spec": asdict(spec), "engine_config": config.to_dict(), "graph": graph, "step_ms": step_ms,
            "collectives": collectives or {}}
    return RegionsResult(per_layer=per_layer, summed=summed, summary=summary, meta=meta,
                         native=native_table(native or [], n, step_mean))


# ---------------------------------------------------------------------------------------------------------------
# Cost of the timer machinery: timing disabled vs no timer at all, side by side in one process


def timing_overhead(config: Any, spec: RegionsSpec, rounds: int = 5, threads: int | None = None) -> pd.DataFrame:
    """Cost of the timer machinery, measured side by side on ONE runner (same compiled graphs).

    Variants: `no_timer` (the step loop makes no timer calls at all), `disabled` (a disabled RegionTimer: one shared
    nullcontext per region, `no_split` compiled into the graphs) and `enabled` (for reference: graph breaks, a sync and
    a clock read at every boundary). Each round re-prefills the same prompts, then cycles the variants step by step
    (in a rotating order), so slow drifts of a shared machine's load hit all variants alike.
    `vs_no_timer` is the median over cycles of the paired ratio step_ms / no_timer step_ms of the same cycle, minus 1;
    `p10_vs_no_timer` compares the 10th percentiles (the least disturbed steps of a shared machine).
    A last row, `disabled_region_us`, is the cost of entering one disabled region, from a tight loop."""
    from engine import run_job

    if config.cp != 1:
        raise ValueError("timing_overhead runs on one rank (cp 1)")
    return run_job(config.replace(region_timing=False), _overhead_job, (spec, rounds), threads=threads)


def _overhead_job(engine: Any, spec: RegionsSpec, rounds: int) -> pd.DataFrame:
    from engine.profiling import RegionTimer

    steps_per_round = OVERHEAD_ROUND_STEPS
    runner = engine.runner
    if runner.regions is None:
        raise ValueError("timing_overhead needs --graph-mode regions or layer")
    disabled = runner.regions.timer
    enabled = RegionTimer(enabled=True, synchronize=runner.regions.backend.synchronize)
    variants = {"no_timer": None, "disabled": disabled, "enabled": enabled}
    names = list(variants)
    samples: dict[str, list[float]] = {k: [] for k in variants}
    shapes = None
    for r in range(rounds + 1):  # round 0 compiles and warms every variant up and is dropped
        state = {"i": 0, "current": names[0]}
        runner.regions.timer = variants[names[0]]

        def on_step(index: int, seconds: float, decoding: bool, r: int = r, state: dict = state) -> None:
            if decoding:  # the step that just ran used state["current"]; pick the next one (rotating order)
                if r:
                    samples[state["current"]].append(seconds * 1e3)
                state["i"] += 1
            i = state["i"]
            cycle = names[(i // 3) % 3:] + names[: (i // 3) % 3]  # no variant always runs first
            state["current"] = cycle[i % 3]
            runner.regions.timer = variants[state["current"]]

        run_batch(engine, _prompts(engine, spec, r), 3 * steps_per_round + 1, on_step=on_step)
        if r == 0:
            shapes = len(runner.regions.compiled)
    runner.regions.timer = disabled
    if len(runner.regions.compiled) != shapes:
        raise RuntimeError("a new block bucket was compiled during the measured rounds; use a shorter run")
    n = min(len(v) for v in samples.values())
    samples = {k: v[:n] for k, v in samples.items()}
    base = samples["no_timer"]
    rows = [{"variant": k, "rounds": rounds, "steps_per_round": steps_per_round,
             "step_ms_median": quantiles(v, 50)[0], "step_ms_p10": quantiles(v, 10)[0],
             "step_ms_p90": quantiles(v, 90)[0],
             "vs_no_timer": quantiles([a / b for a, b in zip(v, base, strict=True)], 50)[0] - 1.0,
             "p10_vs_no_timer": quantiles(v, 10)[0] / quantiles(base, 10)[0] - 1.0}
            for k, v in samples.items()]
    n = 200_000
    t0 = time.perf_counter()
    for _ in range(n):
        with disabled.region("attn", 0):
            pass
    us = (time.perf_counter() - t0) / n * 1e6
    per_step = us * runner.regions.launches_last_step
    rows.append({"variant": "disabled_region_us", "rounds": 0, "steps_per_round": n, "step_ms_median": us / 1e3,
                 "step_ms_p10": float("nan"), "step_ms_p90": float("nan"),
                 "vs_no_timer": per_step / 1e3 / quantiles(base, 50)[0], "p10_vs_no_timer": float("nan")})
    return pd.DataFrame(rows, columns=OVERHEAD_COLUMNS)


def save_plot(result: RegionsResult, path: Path) -> Path:
    """Stacked bars: one bar per (region, layer), stages stacked by ms per step; a last bar for the measured step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    df = result.per_layer
    bars = list(dict.fromkeys(zip(df["region"], df["layer"], strict=True)))
    stages = list(dict.fromkeys(df["stage"]))
    cmap = plt.get_cmap("tab20")
    fig, ax = plt.subplots(figsize=(max(7, 0.55 * len(bars) + 4), 4.5))
    labels = [f"{r}" if layer < 0 else f"{r}\nL{layer}" for r, layer in bars]
    bottom = [0.0] * len(bars)
    for si, stage in enumerate(stages):
        vals = []
        for r, layer in bars:
            sel = df[(df["region"] == r) & (df["layer"] == layer) & (df["stage"] == stage)]
            vals.append(float(sel["ms_per_step"].sum()))
        ax.bar(labels, vals, bottom=bottom, label=stage, color=cmap(si % 20))
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    s = result.summary.iloc[0]
    ax.set_ylabel("ms per decode step")
    ax.set_title(f"{s['graph_mode']}: batch {s['batch_size']}, context {s['context_len']}, cp {s['cp']}; "
                 f"step {s['step_ms_mean']:.2f} ms, stages sum {s['stage_sum_ms_per_step']:.2f} ms, "
                 f"{s['graph_launches_per_step']} launches/step", fontsize=9)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
