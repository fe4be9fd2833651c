"""Context + expert parallelism on gloo ranks (processes on this host): results equal cp=1, one MoE all-gather per
layer per step, invalid layouts rejected up front, and a rank that raises or dies ends the job cleanly."""

from __future__ import annotations

import multiprocessing as mp
import time

import pytest
import torch

from engine import run_job
from engine.config import ModelConfig
from engine.parallel import LayoutError, Parallel, RankFailed, check_layout, launch
from tests.engines import config, greedy

TINY = ModelConfig(vocab_size=512, dim=64, n_layers=3, n_mtp_layers=0, compress_ratios=(0, 4, 8), n_hash_layers=1,
                   n_heads=2, head_dim=32, rope_head_dim=16, q_lora_rank=32, o_groups=2, o_lora_rank=16,
                   window_size=8, n_routed_experts=4, n_activated_experts=2, moe_inter_dim=32, index_n_heads=16,
                   index_head_dim=32, index_topk=2, swiglu_limit=1.0, max_position_embeddings=1024)
PROMPTS = [[3, 4], [7] * 5 + list(range(10, 40)), list(range(50, 110))]
NEW = 6


def _config(cp: int = 1, budget: int | None = None):
    return config(TINY, max_num_seqs=3, num_kv_blocks=32, load_format="dummy", seed=7, cp=cp,
                  max_num_batched_tokens=budget)


def _job(engine, prompts: list[list[int]]) -> tuple:
    outs, logits = greedy(engine, prompts, NEW)
    return outs, logits, engine.runner.par.report(), engine.stats().num_steps


def _raise_on_rank1(par: Parallel) -> None:
    if par.rank == 1:
        raise ValueError("boom on purpose")
    torch.distributed.barrier()


@pytest.fixture(scope="module")
def baseline() -> tuple:
    return run_job(_config(), _job, (PROMPTS,))


@pytest.mark.heavy  # graph compiles / ranks: CI runs `-m heavy` beside the default run (docs/ci.md)
@pytest.mark.parametrize("cp,budget", [(2, None), (4, 13)])  # budget: tokens per step (chunked prefill)
def test_cp_equals_cp1(baseline, cp: int, budget: int | None) -> None:
    outs, logits, coll, steps = run_job(_config(cp, budget), _job, (PROMPTS,))
    assert outs == baseline[0]
    for a, b in zip(logits, baseline[1], strict=True):
        assert (a - b).abs().max() < 1e-4
    for layer in range(TINY.n_layers):  # the static MoE exchange: one packed all-gather + one reduce per layer
        assert coll[f"L{layer}.moe.exchange:all_gather"] == steps
        assert coll[f"L{layer}.moe.combine:all_reduce"] == steps
        assert coll[f"L{layer}.attn.merge:all_gather"] == steps
    # CSA layer only, at most once a step: none in a step whose queries all see at most index_topk entries (the
    # top-k keeps them all: Attention.index_needed; the first chunk here), one in every other step
    assert 0 < coll["L1.index.topk:all_gather"] <= steps
    assert "L2.index.topk:all_gather" not in coll


def test_invalid_layouts_rejected() -> None:
    with pytest.raises(LayoutError, match="does not divide n_routed_experts=4"):
        check_layout(TINY, 3)
    with pytest.raises(LayoutError, match="larger than window_size"):
        check_layout(ModelConfig(**{**TINY.__dict__, "n_routed_experts": 16}), 16)
    check_layout(TINY, 4)


def _assert_no_children() -> None:
    deadline = time.monotonic() + 10
    while mp.active_children() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not mp.active_children(), f"orphan rank processes: {mp.active_children()}"


def test_rank_that_raises_fails_the_job() -> None:
    t0 = time.monotonic()
    with pytest.raises(RankFailed, match=r"rank 1 failed: ValueError: boom on purpose"):
        launch(_raise_on_rank1, 2, timeout_s=120)
    assert time.monotonic() - t0 < 120
    _assert_no_children()


def test_rank_killed_mid_run_fails_the_job_bounded() -> None:
    t0 = time.monotonic()
    with pytest.raises(RankFailed, match=r"rank 1 died \(killed by signal SIGKILL\)"):
        run_job(_config(2), _job, (PROMPTS,), timeout_s=120, kill_at=(1, 10))  # dies at its 10th collective
    assert time.monotonic() - t0 < 120
    _assert_no_children()
