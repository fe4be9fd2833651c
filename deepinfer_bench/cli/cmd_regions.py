"""`deepinfer regions`: per-region, per-stage timing of decode steps (library: bench/region_timing.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from deepinfer_bench.bench.report import DEFAULT_OUT_DIR, err_console, render_df, save_results
from deepinfer_bench.cli.app import app
from deepinfer_bench.cli.options import EngineArgs, engine_options


@app.command("regions")
@engine_options
def regions_cmd(
    engine: EngineArgs,
    timing: Annotated[bool, typer.Option("--timing", help="Time every stage (sync + clock at each split()); also "
                                                          "on with DEEPINFER_NEURON_REGION_TIMING=1.")] = False,
    batch: Annotated[int, typer.Option("--batch", min=1, help="Decode batch size.")] = 4,
    context: Annotated[int, typer.Option("--context", min=1, help="Prompt length before decoding.")] = 64,
    steps: Annotated[int, typer.Option("--steps", min=1, help="Timed decode steps.")] = 20,
    warmup: Annotated[int, typer.Option("--warmup", min=1, help="Untimed decode steps first (compiles).")] = 3,
    overhead: Annotated[bool, typer.Option("--overhead", help="Also measure timing disabled vs no timer machinery "
                                                              "(and enabled), interleaved on one runner.")] = False,
    rounds: Annotated[int, typer.Option("--rounds", min=1, help="Rounds of --overhead (each re-prefills, then "
                                                                "cycles the variants step by step).")] = 5,
    threads: Annotated[int | None, typer.Option("--threads", min=1, help="torch intra-op threads (default: "
                                                "DEEPINFER_NUM_THREADS, else torch's). 1 keeps timings stable on a "
                                                "shared box.")] = None,
    out: Annotated[Path, typer.Option("--out", help="Results folder; each run gets a new sub-folder.")]
    = DEFAULT_OUT_DIR,
) -> None:
    """Time decode steps per region graph and stage (per host-kernel call with --timing).

    Runs decode steps through the region graphs; per region and stage: calls, p50/p90 ms, share of the step, per
    layer and summed over layers; graph launches per step; the measured step time; with --timing on the host
    kernels, every native call (calls and ms per step) and the rest of the step. CSV + meta.json + PNG."""
    from deepinfer_bench.bench.region_timing import RegionsSpec, run_regions, save_plot, timing_overhead, workload
    from engine.backends import measured_on
    from engine.envs import get_envs

    spec = RegionsSpec(batch=batch, context=context, steps=steps, warmup=warmup)
    timing = timing or get_envs().DEEPINFER_NEURON_REGION_TIMING
    config = engine.config(workload=workload(spec), region_timing=timing)
    mode = config.graph.mode
    if overhead and (config.cp != 1 or str(mode) == "eager"):
        raise typer.BadParameter("--overhead needs --cp 1 and --graph-mode regions or layer")
    err_console.print(f"[dim]regions: {mode}, batch {batch}, context {context}, {warmup} warmup + {steps} steps, "
                      f"cp {config.cp}, backend {config.backend}, timing {'on' if timing else 'off'}[/dim]")
    result = run_regions(config, spec, threads=threads)
    render_df(result.summed, f"stages summed over layers ({mode})",
              columns=["region", "stage", "layers", "calls_per_step", "ms_per_step", "p50_ms_sum", "p90_ms_sum",
                       "share_of_step"])
    render_df(result.per_layer, f"stages per layer ({mode})",
              columns=["region", "stage", "layer", "calls", "p50_ms", "p90_ms", "ms_per_step", "share_of_step"])
    render_df(result.summary, "decode step",
              columns=["backend", "graph_mode", "batch_size", "context_len", "cp", "steps", "graph_launches_per_step",
                       "distinct_graphs", "step_ms_p50", "step_ms_p90", "step_ms_mean", "stage_sum_ms_per_step",
                       "stage_sum_over_step"])
    if len(result.native):
        render_df(result.native, "host kernels: each native entry point, and the step outside them")
    vs_plan = None
    if timing and len(result.summed):  # the plan's prediction beside each measured region (deepinfer_bench/plan.py)
        from deepinfer_bench.bench.plan import against_measured, for_engine, launch_text

        pred, inst, _ = for_engine(config, batch, context + warmup + steps // 2, threads=threads)
        vs_plan = against_measured(pred, result.summed, float(result.summary["step_ms_mean"].iloc[0]),
                                   float(result.summary["step_ms_p50"].iloc[0]))
        render_df(vs_plan, f"measured vs `deepinfer plan` ({inst.name}: {inst.hbm_b_s / 1e9:.1f} GB/s, "
                  f"{inst.peak_flop_s / 1e9:.0f} GFLOP/s, {launch_text(inst)})")
    where = measured_on(config.backend)
    if str(config.backend) != "host":
        render_df(result.summary, f"device counters per timed decode step ({where})",
                  columns=["xla_compiles_per_step", "xla_executions_per_step", "d2h_per_step", "h2d_per_step",
                           "fallbacks_per_step", "compiles_during_timing"])
    path = save_results(result.per_layer, out, "regions", {**result.meta, "measured_on": where})
    result.summed.to_csv(path.parent / "regions_summed.csv", index=False)
    result.summary.to_csv(path.parent / "regions_summary.csv", index=False)
    if len(result.native):
        result.native.to_csv(path.parent / "regions_host_kernels.csv", index=False)
    if len(result.per_layer):
        save_plot(result, path.parent / "regions.png")
    if vs_plan is not None:
        vs_plan.to_csv(path.parent / "regions_vs_plan.csv", index=False)
    if overhead:
        df = timing_overhead(config, spec, rounds=rounds, threads=threads)
        render_df(df, "timer cost: per-step medians, interleaved rounds on one runner")
        df.to_csv(path.parent / "regions_overhead.csv", index=False)
    err_console.print(f"-> {path.parent}")

