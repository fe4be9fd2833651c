"""`deepinfer plan` (deepinfer_bench/plan.py): bytes and FLOPs against the engine's own counters on the tiny model,
the fit of launch overhead and collective latency to the 447.8 ms seed with NxDI's V3 check, and the CLI's files."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd
import pytest

from deepinfer_bench.bench import plan
from deepinfer_bench.bench.golden import GOLDEN_DIR


@pytest.fixture(scope="module")
def tiny_engine():
    import engine
    from engine.config import EngineConfig

    return engine.build(EngineConfig.from_model_dir(GOLDEN_DIR / "tiny", kernels="reference", weights="stored",
                                                    max_num_seqs=4))


@pytest.mark.parametrize("batch,context", [(1, 16), (3, 40)])
def test_weight_bytes_and_flops_are_the_engines_counts(tiny_engine, batch: int, context: int) -> None:
    """The plan's weight bytes (bytes - KV) with `weights="held"` are `engine_read_bytes` of the model as the engine
    holds it (FP8/FP4 stored with their scales, wo_a dequantised, fp32 norms / router / compressor / head), except
    tid2eid: the engine's count reads the whole [vocab, K] table, the plan the step's rows (a gather). Its GEMM FLOPs
    (flops - attention) are 2 x `engine_step_fmas`. Context 16: the indexer keeps every
    entry (its query weights skipped); 40: it selects (read)."""
    from deepinfer_bench.bench.engine_vs_hf import engine_read_bytes, engine_step_fmas

    model, cfg = tiny_engine.runner.model, tiny_engine.model_config
    lay = plan.Layout(cp=1, batch=batch, context=context, weights="held", dtype_bytes=model.embed.weight.element_size())
    rows = plan.v4_rows(cfg, lay)
    w = rows["layers"]
    weight_bytes = float(((rows["bytes"] - rows["kv_bytes"]) * w).sum())
    tid2eid = cfg.n_hash_layers * cfg.n_activated_experts * 8
    expected = engine_read_bytes(model, batch, context) - tid2eid * (cfg.vocab_size - batch)
    assert weight_bytes == expected
    gemm = float(((rows["flops"] - rows["attn_flops"]) * w).sum())
    assert gemm == 2 * engine_step_fmas(cfg, model, batch, context)
    assert (rows["stage"] == "attn.index").any() == (context == 40)


def test_rows_per_layer_type_and_the_exchange_per_moe_layer() -> None:
    """V4-Flash at 64 ranks: 2 sliding+hash, 1 CSA+hash, 20 CSA, 20 HCA layers; per layer one attention-merge
    all-gather, one MoE all-gather and one all-reduce (engine/parallel.py), the CSA indexer's all-gather once it
    selects (context > 4 x 512); two launches a layer in `regions`, one in `layer`, one a step as a megakernel."""
    kind, cfg = plan.model_config(GOLDEN_DIR / "configs" / "deepseek-v4-flash")
    assert kind == "v4"
    rows = plan.v4_rows(cfg, plan.Layout(cp=64, batch=1, context=8192))
    layers = rows.drop_duplicates("layer_type").set_index("layer_type")["layers"].to_dict()
    assert layers == {"embed": 1, "sliding+hash": 2, "CSA+hash": 1, "HCA": 20, "CSA": 20, "head": 1}
    calls = (rows["coll_calls"] * rows["layers"]).groupby(rows["stage"]).sum().to_dict()
    assert calls == {"attn.core": 43, "attn.index": 21, "moe.exchange": 43, "moe.combine": 43} | {
        s: 0 for s in calls if s not in ("attn.core", "attn.index", "moe.exchange", "moe.combine")}
    launches = {m: plan.totals(plan.predict(plan.v4_rows(cfg, plan.Layout(cp=64, graph_mode=m)),
                                            plan.trn2_instance("trn2.48xlarge", 2, plan.load_hardware())))["launches"]
                for m in plan.GRAPH_MODES}
    assert launches == {"regions": 2 * 43 + 2, "layer": 43 + 2, "megakernel": 1}


def test_fit_reproduces_the_seed_and_checks_against_nxdi_v3() -> None:
    """The fitted launch overhead and collective latency (stored in hardware.toml) are what `fit()` returns; with
    them the seed's V4-Flash step (64 ranks, regions) is 447.8 ms within 15 % and NxDI's V3 TPOT (TP 64, batch 1,
    seq 512) 20.5 ms within 30 %."""
    hw = plan.load_hardware()
    f = plan.fit(hw)
    print(f"\nseed: predicted {f['seed_predicted_ms']:.1f} ms vs {f['seed_ms']} ms ({f['seed_residual']:+.1%}); "
          f"NxDI V3: predicted {f['v3_predicted_ms']:.2f} ms vs {f['v3_tpot_ms']} ms ({f['v3_residual']:+.1%}); "
          f"launch {f['launch_overhead_us']:.1f} us, collective {f['collective_latency_us']:.1f} us")
    assert f["launch_overhead_us"] == pytest.approx(hw["fitted"]["launch_overhead_us"], abs=0.1)
    assert f["collective_latency_us"] == pytest.approx(hw["fitted"]["collective_latency_us"], abs=0.1)
    assert abs(f["seed_residual"]) <= 0.15
    assert abs(f["v3_residual"]) <= 0.30
    rows, inst = plan._seed_plan(hw)  # the stored constants give the same seed step
    assert plan.totals(plan.predict(rows, inst))["step_ms"] == pytest.approx(f["seed_ms"], rel=1e-3)


def test_every_constant_names_its_source() -> None:
    hw = plan.load_hardware()
    assert hw["trn2_chip"]["source"].startswith("https://")
    for name in ("trn2.48xlarge", "trn2.3xlarge"):
        assert hw["instance"][name]["source"]
    assert hw["check_nxdi_v3"]["source"].startswith("https://")


def test_speculation_divides_the_step_by_the_accepted_tokens() -> None:
    _, cfg = plan.model_config(GOLDEN_DIR / "configs" / "deepseek-v4-flash")
    inst = plan.trn2_instance("trn2.48xlarge", 2, plan.load_hardware())
    lay = plan.Layout(cp=64, batch=1, context=8192)
    s = plan.speculative_step(cfg, inst, lay, "mtp", [0.7, 0.5])
    assert s["tokens_per_step"] == pytest.approx(2.2)
    assert s["ms_per_token"] == pytest.approx(s["step_ms"] / 2.2)
    none = plan.speculative_step(cfg, inst, lay, "dspark", [0.0])
    assert none["ms_per_token"] > plan.totals(plan.predict(plan.v4_rows(cfg, lay), inst))["step_ms"]


def test_cli_writes_csv_meta_and_png(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from tests.cli import run_main

    code, _, err = run_main(["plan", "--model-dir", str(GOLDEN_DIR / "configs" / "deepseek-v4-pro"), "--batch", "8",
                   "--graph-mode", "layer", "--speculative", "dspark", "--acceptance", "0.8,0.6,0.4",
                             "--out", str(tmp_path)], capsys)
    assert code == 0, err
    (run,) = tmp_path.glob("plan-*")
    for name in ("plan.csv", "plan_regions.csv", "plan_summary.csv", "plan_draft.csv", "meta.json", "plan.png"):
        assert (run / name).stat().st_size > 0, name
    meta = json.loads((run / "meta.json").read_text())
    assert meta["layout"]["batch"] == 8 and meta["instance"]["ranks"] == 64
    assert math.isclose(meta["summary"]["spec_tokens_per_step"], 2.8)
    draft = pd.read_csv(run / "plan_draft.csv")
    assert set(draft["layer_type"]) == {"embed", "MTP", "head"}
    code, _, err = run_main(["plan", "--instance", "trn9"], capsys)
    assert code == 2 and "trn9" in err and len(err.strip().splitlines()) == 1


def test_width_free_copy_keeps_the_structure_and_the_routed_expert_path() -> None:
    """The host's call overheads are measured on a width-free copy (`plan.with_engine_overheads`): the same layers,
    compress ratios, hash layers, heads and experts at small widths, running the routed-expert path `--moe auto`
    would take at the real widths (engine/model/moe.py MoE.static_mode)."""
    from engine.model.capabilities import HOST
    from engine.model.moe import MoE
    from engine.model_config import ModelConfig

    _, flash = plan.model_config(GOLDEN_DIR / "configs" / "deepseek-v4-flash")
    small = plan.width_free(flash)
    for k in ("n_layers", "compress_ratios", "n_hash_layers", "n_heads", "n_routed_experts", "n_activated_experts",
              "window_size", "index_topk"):
        assert getattr(small, k) == getattr(flash, k), k
    assert small.dim == 256 and small.vocab_size == 1024 and small.moe_inter_dim == 128
    cfg = ModelConfig(**{**flash.__dict__, "n_routed_experts": 32, "n_activated_experts": 4, "dim": 1024,
                         "moe_inter_dim": 512})
    moe = MoE(cfg, 3)
    moe.caps = HOST
    for t in (1, 7, 8, 16):
        assert plan._moe_mode(cfg, t, 1) == moe.static_mode(t), t
