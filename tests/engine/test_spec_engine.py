"""Speculative decoding on the real tiny model: whatever the drafts, the tokens and the logits they come from are the
plain engine's. Drafts that are all right, all wrong and alternately right exercise acceptance at every position of
every compression boundary (CSA m = 4, HCA m = 16) and across the window ring's wrap (window 16): the slot state is
indexed by position with spare rows for drafts (engine/model/cache.py), so a rejected draft needs no rollback - these
tests are what shows it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import engine
from deepinfer_bench.bench.golden import GOLDEN_DIR, golden_config, run_golden
from engine.config import EngineConfig
from engine.llm import greedy_with_logits
from engine.model import drafting as draft_mod

TINY = Path(__file__).resolve().parents[2] / "golden" / "tiny"
PROMPTS = [list(range(3, 10)), torch.randint(3, 1000, (37,), generator=torch.Generator().manual_seed(1)).tolist()]
NEW = 44  # crosses HCA blocks (16) and several CSA blocks (4) and wraps the window (16)


def _run(monkeypatch: pytest.MonkeyPatch | None, k: int, oracle: list[list[int]] | None, mode: str):
    cfg = EngineConfig.from_model_dir(TINY, max_num_seqs=2, max_model_len=96, num_kv_blocks=16,
                                      **({"speculative": "mtp", "num_speculative_tokens": k} if k else {}))
    eng = engine.build(cfg)
    if k:
        real = draft_mod.draft_for_requests
        slots: dict[int, int] = {}

        def drafts(model, cache, config, steps, hidden, captured, requests):
            out = real(model, cache, config, steps, hidden, captured, requests)  # the block's catch-up is real
            for r, toks in zip(requests, out, strict=True):
                if not r.want:
                    continue
                seq = slots.setdefault(r.slot, len(slots))  # slot -> prompt index (both requests start together)
                end = r.start + r.n  # the bonus token sits at `end`; drafts are tokens end + 1, ...
                true = oracle[seq][end + 1 - len(PROMPTS[seq]): end + 1 - len(PROMPTS[seq]) + r.want]
                if mode == "right":
                    toks[:] = true
                elif mode == "wrong":
                    toks[:] = [(t + 1) % cfg.model.config.vocab_size for t in true]
                else:  # alternately right and wrong by position
                    toks[:] = [t if (end + 1 + j) % 2 else (t + 1) % 1024 for j, t in enumerate(true)]
            return out

        monkeypatch.setattr(draft_mod, "draft_for_requests", drafts)
    outs, logits = greedy_with_logits(eng, PROMPTS, NEW)
    return outs, logits, eng


@pytest.fixture(scope="module")
def plain():
    outs, logits, _ = _run(None, 0, None, "")
    return outs, logits


@pytest.mark.parametrize("k, mode", [(1, "right"), (3, "right"), (3, "wrong"), (2, "alternate"), (4, "alternate")])
def test_tokens_and_logits_are_the_plain_engines(plain, monkeypatch: pytest.MonkeyPatch, k: int, mode: str) -> None:
    outs, logits, eng = _run(monkeypatch, k, plain[0], mode)
    assert outs == plain[0]
    for a, b in zip(logits, plain[1], strict=True):
        assert a.shape == b.shape and float((a - b).abs().max()) < 1e-4
    st = eng.spec_stats
    if mode == "right":
        assert st.num_accepted_tokens == st.num_draft_tokens > 0 and eng.stats().num_steps < NEW // k + 8
    elif mode == "wrong":
        assert st.num_accepted_tokens == 0 and st.num_draft_tokens > 0
    else:
        assert 0 < st.num_accepted_tokens < st.num_draft_tokens


@pytest.mark.slow  # ~35 s alone; the default run covers preemption with the fake runner (tests/test_speculative.py)
def test_golden_with_speculation_under_scheduler_pressure() -> None:
    """The trained MTP block's real drafts, 3 at a time, with chunked prefill and preemption: 12/12 against HF."""
    run = run_golden(golden_config(speculative="mtp", num_speculative_tokens=3, max_num_seqs=3,
                                   max_num_batched_tokens=24, num_kv_blocks=26), GOLDEN_DIR)
    assert run.ok, run.table.to_string()
    assert run.meta["preemptions"] > 0 and run.meta["speculative"]["num_draft_tokens"] > 0


@pytest.mark.slow
def test_golden_with_speculation_on_cp2() -> None:
    """cp = 2 ranks: every rank runs the MTP block (its attention is sharded too); 12/12 against HF (~2 min)."""
    run = run_golden(golden_config(speculative="mtp", num_speculative_tokens=2, cp=2), GOLDEN_DIR)
    assert run.ok, run.table.to_string()
    assert run.meta["speculative"]["num_accepted_tokens"] > 0
