"""`deepinfer bench engine-vs-hf`: engine and HF reference decode speed, side by side in one run."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from deepinfer_bench.bench.report import DEFAULT_OUT_DIR, err_console, render_df, save_results
from deepinfer_bench.cli.app import bench_app
from deepinfer_bench.cli.options import EngineArgs, engine_options


@bench_app.command("engine-vs-hf")
@engine_options
def engine_vs_hf_cmd(
    engine: EngineArgs,
    prompt_len: Annotated[int, typer.Option(min=1)] = 64,
    steps: Annotated[int, typer.Option(min=2, help="Decode steps per repeat.")] = 64,
    batch: Annotated[str, typer.Option(help="Batch size(s) of the batched-decode measurement, comma-separated "
                                            "(each >= 2), e.g. 2,8.")] = "32",
    repeats: Annotated[int, typer.Option(min=1)] = 3,
    threads: Annotated[int, typer.Option(min=1, help="torch threads for both sides.")] = 1,
    graph_modes: Annotated[str, typer.Option(
        help="Engine graph modes to time, comma-separated (eager, regions, layer); compiled modes compile during "
             "the warm-up. Overrides --graph-mode.")] = "eager,layer",
    kernels_also: Annotated[str, typer.Option(
        help="Other kernel tables to time in the same run beside --kernels, comma-separated (e.g. reference), for "
             "every graph mode.")] = "",
    prefill_len: Annotated[int, typer.Option(min=0, help="Also time the TTFT of one prompt of this many tokens "
                                                         "(0: skip).")] = 0,
    out: Annotated[Path, typer.Option()] = DEFAULT_OUT_DIR,
) -> None:
    """Engine vs HF transformers: decode and prefill speed on the same weights.

    Decode (batch 1 and batch B) and prefill, interleaved in one run; weight bytes read per decode step, achieved
    GB/s and the machine's memory roof; the step's GEMM multiply-adds against the rate an fp32 GEMM reaches here (the
    compute roof)."""
    from deepinfer_bench.bench.engine_vs_hf import run_engine_vs_hf, targets, workload
    from engine.choices import GraphMode, Kernels

    modes = tuple(str(GraphMode.parse(m.strip(), "--graph-modes")) for m in graph_modes.split(",") if m.strip())
    also = tuple(str(Kernels.parse(k.strip(), "--kernels-also")) for k in kernels_also.split(",") if k.strip())
    try:
        batches = tuple(int(b) for b in batch.split(",") if b.strip())
    except ValueError:
        raise ValueError(f"--batch {batch!r}: expected comma-separated integers, e.g. 2,8") from None
    if not batches or min(batches) < 2:
        raise ValueError(f"--batch {batch!r}: every batch size must be >= 2 (batch 1 is always timed)")
    if (engine.cp or 1) != 1:
        raise ValueError("engine-vs-hf times one process against HF: --cp must be 1")
    config = engine.config(workload=workload(max(batches), prompt_len, steps, prefill_len))
    err_console.print(f"[dim]timing {repeats} x {steps} decode steps after a {prompt_len}-token prefill; engine: "
                      f"{config.model.dtype}, weights {config.model.weights}, kernels {config.kernels} "
                      f"({config.kernels_why}), moe {config.graph.moe}"
                      f"{'; also kernels ' + ','.join(also) if also else ''}; {threads} thread(s) each side ...[/dim]")
    df, pre, ratios = run_engine_vs_hf(config, prompt_len=prompt_len, steps=steps, batch=batches, repeats=repeats,
                                       threads=threads, graph_modes=modes, prefill_len=prefill_len,
                                       kernels_also=also)
    render_df(df, f"decode: deepinfer vs HF transformers ({config.model.dtype}, same weights, same run; memory "
                  f"roof {ratios['memory_bandwidth_gb_s']:.1f} GB/s: the best of {ratios['memory_probes']:.0f} copy "
                  f"probes through the run, the lowest {ratios['memory_bandwidth_min_gb_s']:.1f}; GEMM roof "
                  f"{ratios['gemm_rate_g_s']:.1f} G multiply-adds/s, fp32 torch.mm)")
    if len(pre):
        render_df(pre, f"prefill: TTFT of one {prefill_len}-token prompt")
    render_df(targets(ratios, modes, batches, prefill_len, also), "targets")
    path = save_results(df, out, "engine_vs_hf", {"ratios": ratios, "engine_config": config.to_dict()})
    if len(pre):
        pre.to_csv(path.parent / "engine_vs_hf_prefill.csv", index=False)
    err_console.print(f"-> {path}")
