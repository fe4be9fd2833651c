"""Verify steps on the fast path: the K+1 rows of a verify step and the MTP block's catch-up run as decode rows
(engine/model/cache.py `StepPlan.build` decode_rows), so on the host table every layer of them is one native call, as
in a plain decode step, and never the eager chunk path; their logits are the chunk path's within the golden's fp32
tolerance."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import engine
from deepinfer_bench.bench.golden import FP32_LOGIT_TOL
from engine import host_kernels as H
from engine.config import EngineConfig
from engine.llm import greedy_with_logits
from engine.model import mtp_proposer
from engine.model.attention import Attention

TINY_SPEC = Path(__file__).resolve().parents[2] / "golden" / "tiny-spec"
PROMPTS = [list(range(3, 12)), [7, 300, 41, 2, 2, 9, 13, 600, 5, 8, 21, 34, 55]]
NEW = 24  # past the window (16) and several CSA (4) / HCA (16) blocks


def _run(monkeypatch: pytest.MonkeyPatch, fast: bool) -> tuple[list, list, int, dict, int]:
    """Greedy MTP k = 2 on tiny-spec with host kernels: (tokens, logits, eager chunks past the prompts, dispatch
    counts, decode steps: every step after the one prefill step); `fast` False: verify rows and catch-ups as one
    chunk per sequence (the eager path)."""
    late_chunks = [0]
    real_chunk = Attention._chunk

    def chunk(self, q, kv, aux, s, cache, rows):
        late_chunks[0] += s.start >= len(PROMPTS[0])  # a chunk after the shorter prompt: a verify or a catch-up
        return real_chunk(self, q, kv, aux, s, cache, rows)

    with monkeypatch.context() as m:
        m.setattr(Attention, "_chunk", chunk)
        if not fast:
            m.setattr(mtp_proposer, "_decode_rows", lambda model, cache: 1)
        cfg = EngineConfig.from_model_dir(TINY_SPEC, kernels="host", max_num_seqs=2, speculative="mtp",
                                          num_speculative_tokens=2, enable_prefix_caching=False)
        eng = engine.build(cfg)
        if not fast:
            eng.runner.decode_rows = 1
        late_chunks[0] = 0
        outs, logits = greedy_with_logits(eng, PROMPTS, NEW)
    return outs, logits, late_chunks[0], dict(eng.runner.dispatcher.counts), eng.stats().num_steps - 1


def test_verify_rows_take_the_native_layer_and_give_the_chunk_paths_logits(monkeypatch: pytest.MonkeyPatch) -> None:
    outs, logits, late, counts, steps = _run(monkeypatch, fast=True)
    ref_outs, ref_logits, ref_late, ref_counts, _ = _run(monkeypatch, fast=False)
    assert late == 0 and ref_late > 0  # no verify step or catch-up ran the chunk path; the eager run did
    assert steps > 0
    # the build's row limits (MAX_M) take 2 x 3 verify rows natively (not the portable build: there every site
    # declines and the decode rows run op by op)
    if all(H.max_m(k) >= 6 for k in ("mhc", "sparse_attn", "linear", "fp8", "fp4")):
        # each decode step: the target's 4 layers over its verify rows, then (but after the last step) the MTP block's
        # catch-up and recursion; the eager run took only the recursion's one-row steps natively
        assert counts[("host.attn_decode", "host")] >= 4 * steps + 2 * (steps - 1) > ref_counts[("host.attn_decode",
                                                                                                  "host")]
        assert counts[("host.decode_layer", "host")] > ref_counts[("host.decode_layer", "host")]
    assert outs == ref_outs
    dlogit = max(float((a - b).abs().max()) for a, b in zip(logits, ref_logits, strict=True))
    assert dlogit <= FP32_LOGIT_TOL, dlogit
    assert all(torch.isfinite(x).all() for x in logits)
