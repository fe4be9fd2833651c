"""Speculative decoding in the engine step: acceptance, the target distribution kept exactly, and the loop over a fake
runner whose draft head is right most of the time (continuous batching, chunked prefill, preemption, stops)."""

from __future__ import annotations

import math

import pytest
import torch

from engine.llm import LLMEngine, SamplingParams
from engine.sampler import make_generator
from engine.speculative import SpecStats, accept, probs
from tests.fake_runner import FakeRunner, SpecFakeRunner, fake_config


def test_greedy_accepts_the_longest_matching_prefix_and_adds_one() -> None:
    v = 7
    rows = torch.full((4, v), -5.0)
    for i, best in enumerate([3, 1, 4, 6]):
        rows[i, best] = 5.0
    greedy = SamplingParams(temperature=0)
    assert accept(rows, [3, 1, 4], greedy, None) == ([3, 1, 4, 6], 3)  # all accepted + bonus
    assert accept(rows, [3, 2, 4], greedy, None) == ([3, 1], 1)  # the correction replaces the first wrong draft
    assert accept(rows, [0, 1, 4], greedy, None) == ([3], 0)
    with pytest.raises(ValueError, match="3 drafts has 4 target rows"):
        accept(rows[:3], [3, 1, 4], greedy, None)


def _chi2(counts: torch.Tensor, p: torch.Tensor) -> float:
    n = counts.sum()
    expected = n * p
    keep = expected > 0
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=4),
                                    SamplingParams(temperature=1.3, top_p=0.8)])
def test_rejection_sampling_keeps_the_target_distribution(params: SamplingParams) -> None:
    """Whatever the drafts, the first emitted token is distributed as p_0 and, given it equals draft 1, the second as
    p_1 (the rows a verify step conditions on the drafts). Bound: a chi-square statistic over V - 1 = 5 degrees of
    freedom above 30 has probability < 2e-5 under the null; 20,000 draws per case."""
    torch.manual_seed(0)
    v, trials = 6, 20_000
    target = torch.randn(3, v) * 1.5
    p = probs(target, params)
    drafts = [int(p[0].argmax()), int(p[1].argsort()[-2])]  # a likely and a less likely draft
    first = torch.zeros(v)
    second = torch.zeros(v)
    g = make_generator(1234)
    for _ in range(trials):
        toks, a = accept(target, drafts, params, g)
        first[toks[0]] += 1
        if toks[0] == drafts[0]:
            second[toks[1]] += 1
        assert len(toks) == a + 1 and toks[:a] == drafts[:a]
    assert _chi2(first, p[0]) < 30, (first / trials, p[0])
    assert _chi2(second, p[1]) < 30, (second / second.sum(), p[1])


def test_spec_stats() -> None:
    s = SpecStats()
    assert math.isnan(s.acceptance_rate)
    s.add(3, 2)
    s.add(3, 0)
    s.add(1, 1)
    assert (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens) == (3, 7, 3)
    assert s.per_position() == [2 / 3, 1 / 2, 0.0]
    assert s.mean_accepted_length == 1 + 3 / 3 and s.acceptance_rate == 3 / 7


def _spec_engine(k: int, *, max_num_seqs: int = 4, budget: int = 64, num_kv_blocks: int = 32, block_size: int = 8,
                 wrong_every: int = 3) -> LLMEngine:
    cfg = fake_config(max_num_seqs, budget, num_kv_blocks, block_size, speculative="mtp", num_speculative_tokens=k)
    runner = SpecFakeRunner(max_num_seqs, num_kv_blocks, block_size, 256, wrong_every=wrong_every)
    return LLMEngine(cfg, runner)


def _run(engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams]) -> dict[str, list[int]]:
    rids = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    out: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finished:
                assert o.output_token_ids == out[o.request_id]  # the deltas add up to the output
    return {r: out[r] for r in rids}


@pytest.mark.parametrize("k", [1, 2, 4])
def test_greedy_speculation_gives_exactly_the_plain_greedy_tokens(k: int) -> None:
    """Continuous batching (requests of different lengths accept different counts in one step), several tokens per
    step, and the outputs are token for token the model's greedy ones; about 2 in 3 drafts are accepted."""
    eng = _spec_engine(k)
    prompts = [[5, 6, 7], list(range(10, 40)), [3] * 17, [8, 9]]
    ns = [20, 11, 33, 7]
    got = _run(eng, prompts, [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in ns])
    ref = FakeRunner()
    for (rid, toks), p, n in zip(got.items(), prompts, ns, strict=True):
        assert toks == ref.reference_greedy(p, n), rid
    st = eng.spec_stats
    assert st.num_drafts > 0 and 0.3 < st.acceptance_rate < 0.95, st.to_dict()
    assert eng.stats().num_steps < sum(ns)  # fewer steps than tokens: several land per step


def test_speculation_under_chunked_prefill_and_preemption_is_invisible() -> None:
    """A tight pool (preemptions drop drafts and recompute) and a small token budget (chunked prefills next to verify
    steps, drafts cut to the budget): the outputs are still the greedy ones and no block leaks."""
    eng = _spec_engine(3, max_num_seqs=3, budget=12, num_kv_blocks=9, block_size=8)
    prompts = [list(range(2, 2 + n)) for n in (25, 9, 30, 14, 5)]
    ns = [30, 18, 12, 25, 9]
    got = _run(eng, prompts, [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in ns])
    ref = FakeRunner()
    for toks, p, n in zip(got.values(), prompts, ns, strict=True):
        assert toks == ref.reference_greedy(p, n)
    assert eng.stats().num_preemptions > 0 and eng.stats().num_used_blocks == 0
    assert eng.spec_stats.num_accepted_tokens > 0


def test_stop_tokens_and_max_tokens_inside_an_accepted_run() -> None:
    """A stop token or max_tokens in the middle of the accepted drafts ends the request right there: the tokens
    after it are dropped, usage counts only what was emitted."""
    ref = FakeRunner()
    prompt = [4, 5, 6]
    full = ref.reference_greedy(prompt, 40)
    stop = full[9]
    eng = _spec_engine(4)
    got = _run(eng, [prompt, prompt], [SamplingParams(temperature=0, max_tokens=40, stop_token_ids=(stop,)),
                                       SamplingParams(temperature=0, max_tokens=13, ignore_eos=True)])
    a, b = got.values()
    assert a == full[: full.index(stop) + 1] and b == full[:13]


def test_logprobs_and_logits_hook_see_the_row_each_token_came_from() -> None:
    """Each emitted token's logprobs (and the golden's logits hook) come from the target row it was accepted or
    sampled from: the same values as without speculation."""
    params = SamplingParams(temperature=0, max_tokens=15, ignore_eos=True, logprobs=2)

    def collect(eng: LLMEngine) -> tuple[list, list]:
        rows: list[torch.Tensor] = []
        eng.on_logits = lambda ids, lg: rows.extend(lg)
        eng.add_request([7, 8, 9], params)
        lps = []
        while eng.has_unfinished():
            for o in eng.step():
                lps.extend(o.logprobs or [])
        return lps, rows

    lp_spec, rows_spec = collect(_spec_engine(3))
    lp_plain, rows_plain = collect(LLMEngine(fake_config(4, 64, 32, 8), FakeRunner(4, 32, 8, 256)))
    assert [x.token_id for x in lp_spec] == [x.token_id for x in lp_plain]
    assert all(abs(a.logprob - b.logprob) < 1e-6 and a.top == b.top for a, b in zip(lp_spec, lp_plain, strict=True))
    assert len(rows_spec) == len(rows_plain) == 15
    assert all(torch.equal(a, b) for a, b in zip(rows_spec, rows_plain, strict=True))


def test_sampled_requests_speculate_with_their_own_generator() -> None:
    """A seeded sampled request through the spec loop is reproducible (same seed, same tokens), whatever else runs."""
    params = SamplingParams(temperature=0.8, seed=7, max_tokens=20, ignore_eos=True)
    a = _run(_spec_engine(2), [[1, 2, 3]], [params])
    b = _run(_spec_engine(2), [[1, 2, 3], [9, 9]], [params, SamplingParams(temperature=0, max_tokens=5)])
    assert list(a.values())[0] == list(b.values())[0]
