"""The MTP block (`mtp.0.*`) loads from the official checkpoint and runs with its own (sliding-only) cache;
fed token by token it equals one pass over the whole sequence."""

from __future__ import annotations

import torch

import engine
from deepinfer_bench.bench.golden import GOLDEN_DIR
from engine.config import EngineConfig
from engine.model.cache import SeqStep, StepPlan
from engine.runner import ModelRunner


def _runner(with_mtp: bool) -> ModelRunner:
    config = EngineConfig.from_model_dir(GOLDEN_DIR / "tiny", max_num_seqs=1, num_kv_blocks=8, with_mtp=with_mtp)
    return engine.build(config).runner


def _mtp_logits(runner: ModelRunner, ids: torch.Tensor, chunks: list[int]) -> torch.Tensor:
    table, out, start = torch.arange(8), [], 0
    for n in chunks:
        steps = [SeqStep(slot=0, start=start, n=n, token_start=0, block_table=table)]
        x = runner.forward(steps, ids[start:start + n], return_hidden=True)  # [n, hc, dim] main streams
        plan = StepPlan.build(steps, runner.block_size)
        out.append(runner.model.mtp_logits(x, ids[start + 1:start + n + 1], plan, runner.cache))
        start += n
    return torch.cat(out)


def test_mtp_loads_and_incremental_equals_full() -> None:
    ids = torch.randint(2, 1000, (41,), generator=torch.Generator().manual_seed(0))
    full = _mtp_logits(_runner(True), ids, [40])
    step = _mtp_logits(_runner(True), ids, [17] + [1] * 23)
    assert full.shape == (40, 1024) and torch.isfinite(full).all()
    assert (full - step).abs().max() < 1e-4
    # MTP predicts token t+2 from position t: its logits differ from the main head's
    main = _runner(False)
    head = main.forward([SeqStep(0, 0, 40, 0, torch.arange(8))], ids[:40], logit_index=torch.arange(40))
    assert (head - full).abs().max() > 1e-2
