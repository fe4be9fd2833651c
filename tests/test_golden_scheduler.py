"""Greedy through the scheduler equals the golden: every golden prompt in ONE continuous batch, with chunked prefill
and a pool small enough that requests wait and get preempted (recompute), must give the golden token ids exactly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.llm import LLM, EngineConfig, SamplingParams

GOLDEN = Path(__file__).resolve().parents[1] / "golden"


def _check(names: set[str] | None, max_new: int | None, budget: int, extra_blocks: int) -> None:
    meta = json.loads((GOLDEN / "golden.json").read_text())
    prompts = [p for p in meta["prompts"] if names is None or p["name"] in names]
    # A greedy continuation's first k tokens do not depend on max_tokens: a prefix of the golden is a valid golden.
    wants = [p["output_ids"][:max_new] if max_new else p["output_ids"] for p in prompts]
    longest = max(p["prompt_len"] + len(w) for p, w in zip(prompts, wants, strict=True))
    block_size = 16
    need = -(-longest // block_size)
    # Small token budget: prompts prefill in chunks next to running decodes. Pool: the longest request plus
    # `extra_blocks`, far less than the batch needs, so requests wait and the newest get preempted (recompute).
    cfg = EngineConfig(model_dir=str(GOLDEN / "tiny"), max_num_seqs=min(6, len(prompts)),
                       max_num_batched_tokens=budget, num_kv_blocks=need + extra_blocks, block_size=block_size,
                       max_model_len=longest)
    llm = LLM(cfg)
    params = [SamplingParams(temperature=0, max_tokens=len(w), ignore_eos=True) for w in wants]
    outs = llm.generate([p["prompt_ids"] for p in prompts], params)
    bad = []
    for p, want, o in zip(prompts, wants, outs, strict=True):
        got = o.output_token_ids
        if got != want:
            diffs = [i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b]
            step = diffs[0] if diffs else min(len(got), len(want))
            bad.append(f"{p['name']}: first divergence at step {step} (got {got[step:step + 4]}, "
                       f"want {want[step:step + 4]})")
    stats = llm.engine.stats()
    assert not bad, "greedy through the scheduler != golden:\n" + "\n".join(bad)
    assert stats.num_used_blocks == 0 and stats.num_preemptions > 0, stats


def test_greedy_through_scheduler_equals_golden_quick():
    # Sized with the fake runner: 12 steps, ids_17 prefilled in two chunks, then preempted when ids_16's first
    # decode needs a second block of the 2-block pool; ids_20 waits.
    _check({"ids_16", "ids_17", "ids_20"}, max_new=4, budget=24, extra_blocks=0)


@pytest.mark.slow
def test_greedy_through_scheduler_equals_golden_all_prompts():
    _check(None, None, budget=48, extra_blocks=1)
