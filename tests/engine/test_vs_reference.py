"""The engine against the independent HF reference (transformers>=5.24 DeepseekV4ForCausalLM, fp32) on random valid
tiny V4 configs with random weights: greedy tokens identical and logits close, with prefill whole or in chunks and
several sequences of different lengths decoded as one batch."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.config import ModelConfig
from engine.model.dummy import random_weights
from tests.engines import build, greedy

pytest.importorskip("transformers", minversion="5.24", reason="the HF reference needs the `reference` extra")
pytestmark = pytest.mark.reference

from deepinfer_bench.bench.hf_reference import build_hf_model, hf_greedy  # noqa: E402

# fp32 vs fp32: only summation order differs (~1e-5 observed); 1e-3 is the golden tolerance.
LOGIT_TOL = 1e-3


@st.composite
def tiny_configs(draw: st.DrawFn) -> ModelConfig:
    n_layers = draw(st.integers(2, 4))
    hca = draw(st.sampled_from([8, 16]))
    ratios = [0] + [draw(st.sampled_from([0, 4, hca])) for _ in range(n_layers - 1)]
    if 4 not in ratios:
        ratios[-1] = 4  # always exercise CSA + indexer
    heads = draw(st.sampled_from([2, 4]))
    groups = draw(st.sampled_from([g for g in (1, 2) if heads % g == 0]))
    experts = draw(st.sampled_from([4, 8]))
    return ModelConfig(
        vocab_size=256, dim=draw(st.sampled_from([32, 64])), n_layers=n_layers, n_mtp_layers=0,
        compress_ratios=tuple(ratios), n_hash_layers=draw(st.integers(0, n_layers - 1)), n_heads=heads,
        head_dim=32, rope_head_dim=draw(st.sampled_from([8, 16])), q_lora_rank=32, o_groups=groups, o_lora_rank=16,
        window_size=draw(st.sampled_from([8, 16])), n_routed_experts=experts, n_activated_experts=2,
        moe_inter_dim=32, index_n_heads=16, index_head_dim=32, index_topk=draw(st.sampled_from([2, 4])),
        hc_mult=draw(st.sampled_from([2, 4])), swiglu_limit=draw(st.sampled_from([0.5, 10.0])),
        route_scale=1.5, max_position_embeddings=512)


# derandomize: the same 6 draws on every run, so CI never meets a fresh exact top-k tie (HF's torch.topk and our
# stable order may break a tie differently) - new draws are explored by raising max_examples locally.
# Opt-in in the default run (`pytest -m slow`): CI lane 2 runs it on every landing, on torch 2.9 (docs/ci.md), and the
# host golden (12/12 against HF) runs on torch 2.13 in lane 1.
@pytest.mark.slow
@settings(max_examples=6, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=tiny_configs(), seed=st.integers(0, 2**16), chunk=st.sampled_from([None, 7, 16]))  # chunk: token budget
def test_engine_matches_hf(cfg: ModelConfig, seed: int, chunk: int | None) -> None:
    weights = random_weights(cfg, seed=seed, with_mtp=False)
    hf = build_hf_model(cfg, weights, dtype=torch.float32)
    eng = build(cfg, weights, max_num_seqs=3, dtype="float32", max_num_batched_tokens=chunk)
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(2, cfg.vocab_size, (n,), generator=g).tolist() for n in (3, 29, 70)]
    outs, logits = greedy(eng, prompts, 10)
    for p, out, lg in zip(prompts, outs, logits, strict=True):
        ref_out, ref_lg = hf_greedy(hf, p, 10)
        diverge = next((i for i, (a, b) in enumerate(zip(out, ref_out, strict=True)) if a != b), None)
        upto = len(out) if diverge is None else diverge + 1
        dl = float((lg[:upto] - ref_lg[:upto]).abs().max())
        if diverge is not None:  # only acceptable at an exact near-tie of the reference's own top 2
            top2 = ref_lg[diverge].topk(2).values
            assert float(top2[0] - top2[1]) < 10 * LOGIT_TOL, (
                f"prompt len {len(p)}: tokens diverge at step {diverge}, {out} vs {ref_out}")
        assert dl < LOGIT_TOL, f"prompt len {len(p)}: max |dlogit| {dl:.2e} (cfg {cfg})"
