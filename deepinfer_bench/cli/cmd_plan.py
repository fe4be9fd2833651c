"""`deepinfer plan`: the predicted cost of a decode step per layer type, region and stage (library:
deepinfer_bench/bench/plan.py)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Annotated

import pandas as pd
import typer

from deepinfer_bench.bench.report import DEFAULT_OUT_DIR, REPO_ROOT, err_console, render_df, save_results
from deepinfer_bench.cli.app import app

DEFAULT_PLAN_MODEL = REPO_ROOT / "golden" / "configs" / "deepseek-v4-flash"


def _acceptance(text: str) -> list[float]:
    try:
        values = [float(a) for a in text.split(",") if a.strip()]
    except ValueError:
        raise typer.BadParameter(f"--acceptance {text!r}: comma-separated numbers in [0, 1]") from None
    if not values or any(not 0.0 <= a <= 1.0 for a in values):
        raise typer.BadParameter(f"--acceptance {text!r}: comma-separated numbers in [0, 1]")
    return values


@app.command("plan")
def plan_cmd(
    model_dir: Annotated[Path, typer.Option("--model-dir", help="Model folder (config.json is enough): a V4 "
                                            "config, or DeepSeek-V3's for NxDI's layout.")] = DEFAULT_PLAN_MODEL,
    instance: Annotated[str, typer.Option("--instance", help="trn2.48xlarge, trn2.3xlarge or host (this CPU, "
                                          "measured now).")] = "trn2.48xlarge",
    cp: Annotated[int | None, typer.Option("--cp", min=1, help="Ranks (default: every logical core of the "
                                           "instance; 1 on the host).")] = None,
    lnc: Annotated[int, typer.Option("--lnc", min=1, max=2, help="Logical NeuronCore config (trn2).")] = 2,
    batch: Annotated[int, typer.Option("--batch", min=1, help="Sequences per decode step.")] = 1,
    context: Annotated[int, typer.Option("--context", min=1, help="Tokens already in each sequence.")] = 8192,
    graph_mode: Annotated[str, typer.Option("--graph-mode", help="regions (two graphs a layer), layer (one), "
                                            "megakernel (one launch a step).")] = "regions",
    kv_cache_dtype: Annotated[str, typer.Option("--kv-cache-dtype", help="auto (bf16) or fp8.")] = "auto",
    speculative: Annotated[str | None, typer.Option("--speculative", help="mtp or dspark: also the cost per token "
                                                    "with speculation at --acceptance.")] = None,
    acceptance: Annotated[str, typer.Option("--acceptance", help="Per-position acceptance rates of the drafts, "
                                            "comma-separated (one per draft token).")] = "0.7",
    weights: Annotated[str | None, typer.Option("--weights", help="stored (the checkpoint's formats) or held (as "
                                                "the engine holds them; default on the host).")] = None,
    dtype: Annotated[str, typer.Option("--dtype", help="Compute dtype of held weights: bfloat16 or float32.")]
    = "bfloat16",
    fit: Annotated[bool, typer.Option("--fit", help="Also re-fit launch overhead and collective latency to the "
                                      "seed (deepinfer_bench/bench/hardware.toml) and print the residuals.")] = False,
    threads: Annotated[int, typer.Option("--threads", min=1, help="torch threads of the host probes.")] = 1,
    host_compiler: Annotated[str, typer.Option("--host-compiler", help="torch.compile backend whose call overhead "
                                               "the host probe measures.")] = "inductor",
    out: Annotated[Path, typer.Option("--out", help="Results folder; each run gets a new sub-folder.")]
    = DEFAULT_OUT_DIR,
) -> None:
    """Predict a decode step's cost per layer type, region and stage on a trn2 or this CPU.

    Per layer type (sliding, CSA, HCA, hash-routed, MTP) and per region and stage: bytes read, FLOPs, collectives,
    graph launches, and the predicted ms = max(bytes / HBM BW, FLOPs / peak) + launches x overhead + collectives x
    (latency + bytes / link BW). Table + CSV + meta.json + stacked-bar PNG."""
    from deepinfer_bench.bench import plan

    if instance not in plan.INSTANCES:
        raise typer.BadParameter(f"--instance {instance!r}: one of {', '.join(plan.INSTANCES)}")
    if graph_mode not in plan.GRAPH_MODES:
        raise typer.BadParameter(f"--graph-mode {graph_mode!r}: one of {', '.join(plan.GRAPH_MODES)}")
    if kv_cache_dtype not in ("auto", "fp8"):
        raise typer.BadParameter(f"--kv-cache-dtype {kv_cache_dtype!r}: auto or fp8")
    if speculative not in (None, "mtp", "dspark"):
        raise typer.BadParameter(f"--speculative {speculative!r}: mtp or dspark")
    if weights not in (None, "stored", "held"):
        raise typer.BadParameter(f"--weights {weights!r}: stored or held")
    if dtype not in ("bfloat16", "float32"):
        raise typer.BadParameter(f"--dtype {dtype!r}: bfloat16 or float32")
    accept = _acceptance(acceptance)
    kind, cfg = plan.model_config(model_dir)
    hw = plan.load_hardware()
    engine_probe = kind == "v4" and graph_mode != "megakernel"  # host: the engine's own regions, not the probe
    inst = (plan.host_instance(threads, host_compiler, probe_calls=not engine_probe) if instance == "host"
            else plan.trn2_instance(instance, lnc, hw))
    ranks = cp or (1 if instance == "host" else inst.ranks)
    if ranks > inst.ranks:
        where = "the host runs one rank" if instance == "host" else f"{instance} at LNC {lnc} has {inst.ranks} ranks"
        raise typer.BadParameter(f"--cp {ranks}: {where}")
    if kind == "v3" and speculative:
        raise typer.BadParameter("--speculative needs a DeepSeek-V4 config")
    dtype_bytes = 2 if dtype == "bfloat16" else 4
    lay = plan.Layout(cp=ranks, batch=batch, context=context, graph_mode=graph_mode,
                      kv_bytes=1.0 + 4 / 64 if kv_cache_dtype == "fp8" else dtype_bytes,  # e4m3 + a scale per 64
                      weights=weights or ("held" if instance == "host" else "stored"), dtype_bytes=dtype_bytes)
    if kind == "v3":
        rows = plan.v3_rows(cfg, ranks, batch, context)
    else:
        rows = plan.v4_rows(cfg, lay)
    if instance == "host" and engine_probe:
        from engine.config import EngineConfig

        econf = EngineConfig.from_model_config(cfg, backend="host", graph_mode=graph_mode, dtype=dtype,
                                               host_compiler=host_compiler, load_format="dummy", region_timing=True)
        inst = plan.with_engine_overheads(inst, econf, batch, context, threads=threads)
    df = plan.with_outside(plan.predict(rows, inst), inst)
    tot = plan.totals(df)
    err_console.print(f"[dim]plan: {model_dir.name}, {instance} (LNC {lnc}), {ranks} ranks, batch {batch}, context "
                      f"{context}, {graph_mode}, KV {kv_cache_dtype}; per rank: HBM {inst.hbm_b_s / 1e9:.0f} GB/s, "
                      f"peak {inst.peak_flop_s / 1e12:.1f} TFLOP/s, {plan.launch_text(inst)}, collective "
                      f"{inst.collective_s * 1e6:.1f} us[/dim]")
    render_df(df, "predicted decode step, per rank (ms_per_layer x layers = ms_per_step)",
              columns=["layer_type", "layers", "region", "stage", "bytes", "flops", "coll_calls", "launches",
                       "mem_ms", "flop_ms", "launch_ms", "coll_ms", "ms_per_step", "share"])
    summary = {**tot, "ms_per_token": tot["step_ms"], "tok_s": batch / tot["step_ms"] * 1e3}
    if kind == "v4":
        resident = plan.resident_bytes(cfg, lay)
        summary |= {"resident_gib_per_rank": resident / 2**30, "hbm_gib_per_rank": inst.hbm_bytes / 2**30,
                    "fits": resident <= inst.hbm_bytes}
    spec = None
    if speculative and kind == "v4":
        spec = plan.speculative_step(cfg, inst, lay, speculative, accept)
        draft = plan.predict(plan.draft_rows(cfg, lay, speculative, len(accept)), inst)
        render_df(draft, f"one {speculative} draft pass ({'one per draft' if speculative == 'mtp' else 'the block'})",
                  columns=["layer_type", "layers", "region", "stage", "bytes", "flops", "coll_calls", "launches",
                           "mem_ms", "launch_ms", "coll_ms", "ms_per_step"])
        summary |= {f"spec_{k}": v for k, v in spec.items()}
        summary["spec_tok_s"] = batch * spec["tokens_per_step"] / spec["step_ms"] * 1e3
    render_df(pd.DataFrame([summary]), "step totals per rank (the step time is the slowest rank's; ranks are "
              "symmetric here)")
    meta = {"model_dir": str(model_dir), "model_kind": kind, "instance": dataclasses.asdict(inst),
            "layout": dataclasses.asdict(lay), "lnc": lnc, "summary": summary, "hardware": hw,
            "speculative": {"method": speculative, "acceptance": accept} if speculative else None}
    if fit:
        f = plan.fit(hw)
        render_df(pd.DataFrame([f]), "fit: launch overhead and collective latency from the seed; NxDI V3 check")
        meta["fit"] = f
    path = save_results(df, out, "plan", meta)
    plan.by_region(df).to_csv(path.parent / "plan_regions.csv", index=False)
    pd.DataFrame([summary]).to_csv(path.parent / "plan_summary.csv", index=False)
    if spec is not None:
        draft.to_csv(path.parent / "plan_draft.csv", index=False)
    plan.save_plot(df, path.parent / "plan.png",
                   f"{model_dir.name}: {instance} LNC {lnc}, {ranks} ranks, batch {batch}, context {context}, "
                   f"{graph_mode}: {tot['step_ms']:.1f} ms/step")
    err_console.print(f"-> {path.parent}")

