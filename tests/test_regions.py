"""Region graphs (engine/regions.py): the static-shape decode path equals the eager path, launch counts, the
capacity-grouped expert path equals the dense one, and the region timer is free when disabled.

Fast tests run the region functions without torch.compile (host compiler `none`: the same static-shape code) plus
one compiled run through dynamo on a 1-layer model; the 4-layer model compiled with aot_eager in both modes is
`slow` (`python -m pytest -m slow tests/test_regions.py`).
"""

from __future__ import annotations

import contextlib
import time

import pytest
import torch

from engine.config import ModelConfig
from engine.model.cache import SeqStep
from engine.model.dummy import random_weights
from engine.model.moe import MoE
from engine.profiling import REST, RegionTimer, no_split, quantiles
from engine.regions import batch_bucket, block_bucket
from engine.runner import ModelRunner
from tests.engines import build, greedy
from tests.test_host_kernels import widest  # noqa: F401  (fixture)

TINY = dict(vocab_size=1024, dim=128, n_layers=4, n_mtp_layers=0, compress_ratios=(0, 4, 16, 4), n_hash_layers=2,
            n_heads=4, head_dim=64, rope_head_dim=16, q_lora_rank=64, o_groups=2, o_lora_rank=32, window_size=16,
            n_routed_experts=8, n_activated_experts=2, moe_inter_dim=64, index_n_heads=16, index_head_dim=32,
            index_topk=4, swiglu_limit=1.0, max_position_embeddings=4096)
# Lengths and NEW tokens cross the window (16), the CSA ratio (4), the HCA ratio (16) and the indexer threshold
# 4 * (topk + 1) = 20; 3 sequences run in the batch bucket 4, so one padded row uses the scratch slot.
PROMPT_LENS = (3, 17, 22)
NEW = 10


def _cfg(**over: object) -> ModelConfig:
    return ModelConfig(**{**TINY, **over})


CSA1 = _cfg(n_layers=1, compress_ratios=(4,), n_hash_layers=0)  # one CSA layer: compressor + indexer


def _prompts(lens: tuple[int, ...] = PROMPT_LENS) -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(2, 1024, (n,), generator=g).tolist() for n in lens]


def _engine(cfg: ModelConfig, **settings: object):
    # the reference table unless a test says otherwise: these tests count the region graphs' launches and MoE paths
    # of the torch ops (--kernels host runs its own MoE call in eager steps; tests/test_host_kernels.py covers it)
    settings = {"kernels": "reference", **settings}
    return build(cfg, random_weights(cfg, 0, with_mtp=False), max_model_len=256, **settings)


def _runner(cfg: ModelConfig, **settings: object) -> ModelRunner:
    return _engine(cfg, **settings).runner


def _run(cfg: ModelConfig, prompts: list[list[int]], new: int, **settings: object) -> tuple:
    eng = _engine(cfg, **settings)
    outs, logits = greedy(eng, prompts, new)
    return outs, logits, eng.runner


def _dlogit(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))


@pytest.fixture(scope="module")
def eager_ref() -> tuple:
    return _run(_cfg(), _prompts(), NEW, graph_mode="eager")


@pytest.mark.parametrize("mode", ["regions", "layer"])
def test_static_regions_match_eager(eager_ref: tuple, mode: str) -> None:
    outs, logits, runner = _run(_cfg(), _prompts(), NEW, graph_mode=mode, host_compiler="none")
    assert outs == eager_ref[0]
    assert _dlogit(logits, eager_ref[1]) < 1e-4
    # layer mode: half the graph launches per step of regions mode
    per_layer = 1 if mode == "layer" else 2
    assert runner.regions.launches_last_step == per_layer * runner.cfg.n_layers
    assert {b for (_, _, b, _) in runner.regions.compiled} == {4}  # 3 sequences padded to the 4-bucket


def test_compiled_layer_mode_matches_eager() -> None:
    """Through dynamo (capture, one graph per static shape, reused) on a 1-layer CSA model (compressor + indexer)."""
    cfg = CSA1
    prompts = _prompts((6, 21))
    ref = _run(cfg, prompts, 4, graph_mode="eager")
    got = _run(cfg, prompts, 4, graph_mode="layer", host_compiler="eager")
    assert got[0] == ref[0]
    assert _dlogit(got[1], ref[1]) < 1e-4
    assert got[2].regions.launches_last_step == 1


def test_compiled_graphs_do_not_grow_with_layers() -> None:
    """Through dynamo on the host: layers of the same structure reuse one compiled graph (functional_call over a
    template region), so a 6-layer model compiles exactly what its 2 distinct layer structures need."""
    import torch._dynamo.utils as dyn

    prompts = _prompts((5, 9))

    def graphs(cfg: ModelConfig) -> tuple[int, int]:
        torch._dynamo.reset()
        dyn.counters.clear()
        _, _, runner = _run(cfg, prompts, 3, graph_mode="layer", host_compiler="eager")
        return dyn.counters["stats"]["unique_graphs"], len(runner.regions.compiled)

    two = _cfg(n_layers=2, compress_ratios=(4, 16), n_hash_layers=0)
    six = _cfg(n_layers=6, compress_ratios=(4, 16, 4, 16, 4, 16), n_hash_layers=0)
    g2, c2 = graphs(two)
    g6, c6 = graphs(six)
    assert c2 == c6 == 2  # (CSA, HCA) x one (batch, block) bucket
    assert g6 == g2 > 0, (g2, g6)


@pytest.mark.heavy  # graph compiles / ranks: CI runs `-m heavy` beside the default run (docs/ci.md)
@pytest.mark.parametrize("moe", ["grouped", "gather", "dense"])
def test_every_routed_expert_path_of_compiled_graphs_matches_eager(eager_ref: tuple, moe: str) -> None:
    """Through dynamo, the batch bucket 4 x K 2 = E 8 routed pairs, each routed-expert path forced: grouped (each
    chosen expert once, between two graphs), gather and dense give the same tokens."""
    outs, logits, runner = _run(_cfg(), _prompts(), NEW, graph_mode="layer", host_compiler="eager", moe=moe)
    assert outs == eager_ref[0]
    assert _dlogit(logits, eager_ref[1]) < 1e-4
    assert runner.regions.launches_last_step == runner.cfg.n_layers


def test_auto_picks_the_routed_expert_path_by_work() -> None:
    """`--moe auto`: gather while T*K < E_local; past that, grouped on the host when dense would do >= 2^24 extra
    multiply-adds (a mid-size layer at batch 16), else dense (small experts; and always on a device)."""
    from engine.model.capabilities import DEVICE
    from engine.model.moe import GROUPED_MIN_EXTRA_MACS

    tiny = MoE(_cfg(), 2)  # E 8, K 2, dim 128, inter 64
    assert [tiny.static_mode(t) for t in (1, 3, 4, 16)] == ["gather", "gather", "dense", "dense"]
    mid = MoE(_cfg(dim=1024, moe_inter_dim=512, n_routed_experts=32, n_activated_experts=4), 2)
    assert [mid.static_mode(t) for t in (7, 8, 16)] == ["gather", "grouped", "grouped"]
    assert (32 - 4) * 8 * 3 * 1024 * 512 >= GROUPED_MIN_EXTRA_MACS > (8 - 2) * 16 * 3 * 128 * 64
    mid.caps = DEVICE  # a graph device: no routing-dependent shapes
    assert [mid.static_mode(t) for t in (7, 16)] == ["gather", "dense"]
    mid.static_moe = "grouped"
    assert mid.static_mode(1) == "grouped"


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["regions", "layer"])
def test_aot_eager_regions_match_eager(eager_ref: tuple, mode: str) -> None:
    outs, logits, runner = _run(_cfg(), _prompts(), NEW, graph_mode=mode, host_compiler="aot_eager")
    assert outs == eager_ref[0]
    assert _dlogit(logits, eager_ref[1]) < 1e-4
    assert runner.regions.launches_last_step == (1 if mode == "layer" else 2) * 4


def test_buckets() -> None:
    assert [batch_bucket(n) for n in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, 16]
    assert batch_bucket(300) == 512
    assert [block_bucket(n, 20) for n in (1, 3, 5, 16, 17)] == [1, 4, 8, 16, 20]


# ---------------------------------------------------------------------------------------------------------------
# Capacity-grouped experts


def _moe_and_routing(seed: int) -> tuple[MoE, torch.Tensor, torch.Tensor, torch.Tensor]:
    cfg = _cfg()
    state = random_weights(cfg, 0, with_mtp=False)
    moe = MoE(cfg, 2)  # a non-hash layer
    names = moe.state_dict(keep_vars=True).keys()
    moe.load_state_dict({k: state[f"layers.2.ffn.{k}"] for k in names}, strict=True, assign=True)
    x = torch.randn(37, cfg.dim, generator=torch.Generator().manual_seed(seed))  # [T, dim]
    w, idx = moe.gate(x, torch.zeros(37, dtype=torch.long))  # [T, K]
    return moe, x, w, idx


def test_capacity_path_equals_dense() -> None:
    moe, x, w, idx = _moe_and_routing(1)
    dense = moe.routed_local(x, w, idx)
    moe.capacity = 4.0  # C = ceil(4 * T * K / E) = T: no expert can overflow
    grouped, overflow = moe.routed_grouped(x, w, idx)
    assert not bool(overflow)
    torch.testing.assert_close(grouped, dense, rtol=0, atol=1e-6)
    assert torch.equal(moe.routed(x, w, idx, grouped=True), grouped) and moe.overflows == 0


def test_capacity_overflow_reruns_dense() -> None:
    moe, x, w, idx = _moe_and_routing(2)
    dense = moe.routed_local(x, w, idx)
    moe.capacity = 0.1  # C = ceil(0.1 * 37 * 2 / 8) = 1: forced overflow
    _, overflow = moe.routed_grouped(x, w, idx)
    assert bool(overflow)
    assert torch.equal(moe.routed(x, w, idx, grouped=True), dense) and moe.overflows == 1


@pytest.mark.parametrize("capacity", [4.0, 0.1])
def test_capacity_prefill_end_to_end(capacity: float) -> None:
    """One prefill step of 3 prompts: capacity 4 never overflows (C >= T), 0.1 always does (dense re-run)."""
    cfg = _cfg()
    prompts = _prompts()
    steps, off = [], 0
    for i, p in enumerate(prompts):
        steps.append(SeqStep(slot=i, start=0, n=len(p), token_start=off, block_table=torch.arange(4 * i, 4 * i + 4)))
        off += len(p)
    ids = torch.tensor([t for p in prompts for t in p])
    logits = {}
    for cf in (0.0, capacity):
        runner = _runner(cfg, moe_capacity=cf)
        logits[cf] = runner.forward(steps, ids)
    torch.testing.assert_close(logits[capacity], logits[0.0], rtol=0, atol=1e-5)
    overflows = sum(b.ffn.overflows for b in runner.model.layers)
    assert (overflows > 0) == (capacity < 1)


# ---------------------------------------------------------------------------------------------------------------
# Region timer


def test_timer_disabled_is_noop() -> None:
    t = RegionTimer(enabled=False)
    ctx = t.region("attn", 0)
    assert isinstance(ctx, contextlib.nullcontext) and t.region("moe", 1) is ctx
    with ctx:
        t.split("attn.qkv")
    assert not t.samples and t.rows() == [] and no_split("x") is None


def test_timer_disabled_runner_records_nothing() -> None:
    _, _, runner = _run(CSA1, _prompts((4, 6)), 2, graph_mode="regions", host_compiler="none")
    assert not runner.timer.enabled and not runner.timer.samples


def test_timer_stages_cover_the_region() -> None:
    t = RegionTimer(enabled=True)
    for _ in range(3):
        with t.region("attn", 2):
            time.sleep(0.002)
            t.split("attn.qkv")
            time.sleep(0.001)
    rows = {(r.region, r.stage, r.layer): r for r in t.rows()}
    assert rows[("attn", "attn.qkv", 2)].calls == 3 and rows[("attn", REST, 2)].calls == 3
    assert rows[("attn", "attn.qkv", 2)].p50_ms >= 2.0


def test_timed_regions_report_stages() -> None:
    _, _, runner = _run(CSA1, _prompts((4, 22)), 3, graph_mode="regions", host_compiler="none",
                        region_timing=True)
    stages = {(r.region, r.stage) for r in runner.timer.rows()}
    for want in [("attn", "attn.hc_pre"), ("attn", "attn.qkv"), ("attn", "attn.compress"), ("attn", "attn.index"),
                 ("attn", "attn.core"), ("attn", "attn.out"), ("attn", "attn.hc_post"), ("moe", "moe.gate"),
                 ("moe", "moe.experts"), ("moe", "moe.shared"), ("moe", "moe.hc_post"), ("embed", REST),
                 ("head", REST)]:
        assert want in stages


def test_quantiles_match_numpy() -> None:
    import numpy as np

    assert quantiles([1.0, 2.0, 3.0, 4.0], 50) == (2.5,) and quantiles([5.0], 90) == (5.0,)
    xs = [0.3, 9.0, 1.5, 2.25, 7.0, 4.0, 4.0]
    assert np.allclose(quantiles(xs, 10, 50, 90, 99), np.percentile(xs, [10, 50, 90, 99]), rtol=0, atol=1e-12)
    assert all(q != q for q in quantiles([], 50, 90))  # NaN when there is nothing to summarise


@pytest.mark.parametrize("compiler", ["none", "eager", "aot_eager"])
@pytest.mark.usefixtures("widest")  # the native kernels at these batches on every build, portable's too
def test_host_kernels_in_layer_graphs_match_eager(compiler: str) -> None:
    """`--kernels host` in decode regions: the native MoE FFN (`moe_ffn`, the custom op `deepinfer::host_moe_ffn`
    inside a graph) and the other native ops give the eager host path's tokens and logits."""
    cfg = CSA1
    prompts = _prompts((6, 21))
    weights = {k: v.bfloat16() if "experts." in k and v.dim() == 2 else v  # bf16 experts: the native MoE's
               for k, v in random_weights(cfg, 0, with_mtp=False).items()}
    runs = []
    for mode in ("eager", "layer"):
        eng = build(cfg, weights, max_model_len=256, graph_mode=mode, host_compiler=compiler, kernels="host")
        runs.append((*greedy(eng, prompts, 4), eng.runner.dispatcher.counts))
    (ref, ref_logits, _), (got, logits, counts) = runs
    assert got == ref
    assert _dlogit(logits, ref_logits) < 1e-4
    assert counts[("host.moe_ffn", "host")] > 0 and counts[("host.rope_tail", "host")] > 0, sorted(counts.items())
