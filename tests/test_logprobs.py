"""Logprobs in the engine: sampled tokens' from the rows they were sampled from, prompt tokens' from the prefill
logits at every prompt position, whatever the chunking and preemption (over the fake runner, whose logits after any
prefix are known without a scheduler)."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.llm import LLMEngine, SamplingParams
from engine.sampler import token_logprobs
from tests.fake_runner import FakeRunner, fake_config


def engine(max_num_seqs=4, budget=32, num_kv_blocks=16, block_size=8, max_model_len=128) -> LLMEngine:
    cfg = fake_config(max_num_seqs, budget, num_kv_blocks, block_size, max_model_len)
    return LLMEngine(cfg, FakeRunner(max_num_seqs, num_kv_blocks, block_size, max_model_len))


def reference_lp(runner: FakeRunner, prefix: list[int]) -> torch.Tensor:
    """log-softmax of the fake model's logits after `prefix` (no scheduler, no cache)."""
    return torch.log_softmax(runner.logits_for_hash(runner.prefix_hash(prefix)), -1)


def test_token_logprobs_rank_top_and_k0():
    logits = torch.tensor([[0.0, 2.0, 1.0, 2.0], [5.0, -1.0, 0.0, 3.0]])  # [2, 4]
    a, b = token_logprobs(logits, [2, 0], [2, 0])
    lp = torch.log_softmax(logits, -1)
    assert a.token_id == 2 and a.logprob == pytest.approx(float(lp[0, 2])) and a.rank == 3
    assert sorted(t for t, _ in a.top) == [1, 3]  # a tie: either order
    assert [v for _, v in a.top] == pytest.approx([float(lp[0, 1])] * 2)
    assert b.rank == 1 and b.top == () and b.logprob == pytest.approx(float(lp[1, 0]))
    assert token_logprobs(logits[:0], [], []) == []
    with pytest.raises(ValueError, match="logits"):
        token_logprobs(logits, [1], [1])


@pytest.mark.parametrize("field", ["logprobs", "prompt_logprobs"])
def test_params_reject_negative_logprobs(field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: -1})


@settings(max_examples=20, deadline=None)
@given(budget=st.integers(3, 40), num_kv_blocks=st.integers(6, 16), k=st.integers(0, 4), seed=st.integers(0, 9999))
def test_prompt_logprobs_equal_the_full_prefix_logits(budget, num_kv_blocks, k, seed):
    """Chunked prefill (any token budget) and preemption (a small pool) never change them, and they arrive once,
    with the first token, the first entry None."""
    rng = random.Random(seed)
    eng = engine(max_num_seqs=3, budget=budget, num_kv_blocks=num_kv_blocks)
    runner = eng.runner
    prompts = [[rng.randrange(97) for _ in range(rng.randrange(1, 40))] for _ in range(4)]
    params = [SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, prompt_logprobs=k if i % 2 == 0 else None,
                             logprobs=k) for i in range(len(prompts))]
    rids = [eng.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    got: dict[str, list] = {r: [] for r in rids}
    while eng.has_unfinished():
        for o in eng.step():
            got[o.request_id].append(o)
    for p, sp, rid in zip(prompts, params, rids, strict=True):
        outs = got[rid]
        with_prompt = [o for o in outs if o.prompt_logprobs is not None]
        if sp.prompt_logprobs is None:
            assert not with_prompt
        else:
            assert len(with_prompt) == 1 and with_prompt[0] is outs[0]
            plp = with_prompt[0].prompt_logprobs
            assert len(plp) == len(p) and plp[0] is None
            for t in range(1, len(p)):
                ref = reference_lp(runner, p[:t])
                e = plp[t]
                assert e.token_id == p[t] and e.logprob == pytest.approx(float(ref[p[t]]), abs=1e-6)
                assert e.rank == int((ref > ref[p[t]]).sum()) + 1 and len(e.top) == k
                assert [i for i, _ in e.top] == ref.topk(k).indices.tolist()
        # sampled tokens: one entry per token, from the row it was drawn from (greedy: rank 1, top-1 is itself)
        toks = [t for o in outs for t in o.new_token_ids]
        lps = [x for o in outs for x in o.logprobs]
        assert len(lps) == len(toks) == 6
        for j, (t, e) in enumerate(zip(toks, lps, strict=True)):
            ref = reference_lp(runner, p + toks[:j])
            assert e.token_id == t and e.rank == 1 and e.logprob == pytest.approx(float(ref.max()), abs=1e-6)
            assert len(e.top) == k and (k == 0 or e.top[0][0] == t)
    assert eng.stats().num_used_blocks == 0


def test_preempted_prompt_logprobs_are_recorded_once():
    eng = engine(max_num_seqs=4, budget=64, num_kv_blocks=6, block_size=8)
    prompts = [[i + 1] * 20 for i in range(4)]
    rids = [eng.add_request(p, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, prompt_logprobs=1))
            for p in prompts]
    firsts = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.prompt_logprobs is not None:
                assert o.request_id not in firsts
                firsts[o.request_id] = o.prompt_logprobs
    assert eng.stats().num_preemptions > 0
    assert all(len(firsts[r]) == 20 for r in rids)


def test_no_logprobs_asked_no_full_logits():
    """Requests without prompt logprobs never make the runner return more than one row per entry."""
    calls = []

    class Spy(FakeRunner):
        def execute(self, batch, full_logits=()):
            calls.append(tuple(full_logits))
            return super().execute(batch, full_logits)

    cfg = fake_config(2, 8, 16, 8, 128)
    eng = LLMEngine(cfg, Spy(2, 16, 8, 128))
    eng.add_request(list(range(1, 20)), SamplingParams(temperature=0, max_tokens=3, logprobs=2))
    eng.add_request(list(range(1, 20)), SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=0))
    while eng.has_unfinished():
        eng.step()
    assert calls and all(c in ((), (0,), (1,)) for c in calls)
    assert any(c for c in calls) and not all(c for c in calls)


# ---- the real model: context parallelism (rank 0's DistributedRunner returns the chunk rows) ------------------------
def _prompt_logprobs_job(engine, prompts: list[list[int]]) -> list[list]:
    rids = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, prompt_logprobs=2,
                                                 logprobs=2)) for p in prompts]
    got: dict[str, list] = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.prompt_logprobs is not None:
                got[o.request_id] = [None if e is None else (e.token_id, e.logprob, [t for t, _ in e.top])
                                     for e in o.prompt_logprobs]
    return [got[r] for r in rids]


@pytest.mark.slow  # two spawned gloo ranks: ~15 s on an idle 2-core box, a minute on a busy one
def test_prompt_logprobs_cp2_chunked_equal_cp1_whole():
    """A small random V4 model (dummy weights): 2 context-parallel ranks with prefill chunks of 13 tokens give the
    prompt logprobs of one rank with whole prefills."""
    from engine import run_job
    from engine.config import ModelConfig
    from tests.engines import config

    cfg = ModelConfig(vocab_size=512, dim=64, n_layers=3, n_mtp_layers=0, compress_ratios=(0, 4, 8), n_hash_layers=1,
                      n_heads=2, head_dim=32, rope_head_dim=16, q_lora_rank=32, o_groups=2, o_lora_rank=16,
                      window_size=8, n_routed_experts=4, n_activated_experts=2, moe_inter_dim=32, index_n_heads=16,
                      index_head_dim=32, index_topk=2, swiglu_limit=1.0, max_position_embeddings=1024)
    prompts = [[3, 4, 5], [7] * 5 + list(range(10, 40))]

    def run(**kw):
        return run_job(config(cfg, max_num_seqs=2, num_kv_blocks=32, load_format="dummy", seed=7, **kw),
                       _prompt_logprobs_job, (prompts,))

    cp1, cp2 = run(cp=1), run(cp=2, max_num_batched_tokens=13)
    for a, b in zip(cp1, cp2, strict=True):
        assert len(a) == len(b) and a[0] is None and b[0] is None
        for x, y in zip(a[1:], b[1:], strict=True):
            assert x[0] == y[0] and abs(x[1] - y[1]) < 1e-4 and x[2] == y[2]
