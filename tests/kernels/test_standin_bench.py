"""scripts/standin_golden_bench.py: the replay of the golden call mix runs on every kernel family (small prompts)."""

from __future__ import annotations

import torch

from nki_kernels import dispatch, kernel_ops
from tests.scripts import load_script


def _load():
    return load_script("scripts/standin_golden_bench.py")


def test_replay_reaches_every_family_without_fallbacks():
    bench = _load()
    cfg, prompts = bench.load_setup()
    assert len(prompts) == 12 and sum(p for p, _ in prompts) == 956
    dispatch.reset_counts()
    ops = bench.TimedOps(kernel_ops.make_ops("stand-in"))
    steps = bench.replay(ops, cfg, [(9, 3), (21, 2)], torch.float32)
    assert steps == 3
    ran = {name for name, ex in dispatch.counts() if ex == "stand-in"}
    assert ran == {"rmsnorm", "swiglu", "blockquant.dense", "blockquant.fp8", "blockquant.fp4", "blockquant.wo_a",
                   "hc_mixes", "hc_collapse", "hc_expand", "compress_pool", "index_score", "sparse_attn"}
    assert not dispatch.fallbacks()
    assert set(ops.calls) == set(kernel_ops.KERNEL_OPS) - {"hc_attn_out", "sparse_attn_partial"}
    dispatch.reset_counts()
