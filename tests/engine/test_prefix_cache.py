"""Prefix caching on the real model: a request whose prompt shares a cached prefix gives the same greedy tokens and
logits as without the cache, at every compression boundary (the tiny model: CSA ratio 4, HCA ratio 16, window 16,
block 16), with speculative decoding, and under preemption with cached blocks evicted."""

from __future__ import annotations

import pytest
import torch

from engine.model.dummy import random_weights
from tests.engine.test_engine_consistency import TINY, TOL
from tests.engines import build, greedy

BS = 16  # default_block_size(TINY): lcm of the ratios 4 and 16


@pytest.fixture(scope="module")
def weights() -> dict[str, torch.Tensor]:
    return random_weights(TINY, seed=1)


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(2, TINY.vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# shared prefix lengths around multiples of 4 (CSA), 16 (HCA, window, block) and several blocks
SHARED = [7, 8, 9, 15, 16, 17, 31, 32, 33, 47, 48, 49, 63, 64, 65]


def test_prefix_hit_is_bitwise_identical(weights) -> None:
    """Requests run one at a time with chunks of one block (so the chunks are the same with and without the cache):
    the second request of each pair takes the first's prefix from the cache, and its tokens and logits equal those
    of an engine without a cache bit for bit."""
    on = build(TINY, weights, max_num_batched_tokens=BS, enable_prefix_caching=True, num_prefix_snapshots=64)
    off = build(TINY, weights, max_num_batched_tokens=BS, enable_prefix_caching=False)
    hits = 0
    for i, shared in enumerate(SHARED):
        prefix = _ids(shared, 100 + i)
        first, second = prefix + _ids(5, 200 + i), prefix + _ids(7, 300 + i)
        greedy(on, [first], 3)
        before = on.stats().prefix_cache_hits
        got, got_logits = greedy(on, [second], 9)  # decodes cross a block boundary
        hit = on.stats().prefix_cache_hits - before
        assert hit == min(shared, len(second) - 1) // BS * BS, shared
        hits += hit
        want, want_logits = greedy(off, [second], 9)
        assert got == want, shared
        assert torch.equal(got_logits[0], want_logits[0]), (shared, (got_logits[0] - want_logits[0]).abs().max())
    assert hits > 0
    s = on.stats()
    assert s.prefix_cache_queries > s.prefix_cache_hits > 0
    assert off.stats().prefix_cache_queries == 0


def test_prefix_hit_same_tokens_with_whole_prefills_and_decode_boundaries(weights) -> None:
    """Default chunking (whole prefills; with the cache the last chunk is cut at its last block boundary): the same
    tokens, logits within fp32 reordering; a multi-turn follow-up hits the blocks its first turn decoded."""
    on = build(TINY, weights, enable_prefix_caching=True)
    off = build(TINY, weights, enable_prefix_caching=False)
    system = _ids(40, 7)
    turn1 = system + _ids(6, 8)
    out1, _ = greedy(on, [turn1], 30)  # decode crosses the boundaries 48, 64
    turn2 = turn1 + out1[0] + _ids(5, 9)
    for prompt in (system + _ids(3, 10), turn2):
        before = on.stats().prefix_cache_hits
        got, got_logits = greedy(on, [prompt], 8)
        want, want_logits = greedy(off, [prompt], 8)
        assert on.stats().prefix_cache_hits > before
        assert got == want
        assert (got_logits[0] - want_logits[0]).abs().max() < TOL
    assert on.stats().prefix_cache_hits >= 64  # turn 2 reused the decoded blocks up to position 64


def test_prefix_cache_with_speculation(weights) -> None:
    """MTP drafts (k=2): the draft layer's window state is cached too (a hit needs the same token after the prefix);
    greedy tokens equal decoding without the cache."""
    kw = dict(speculative="mtp", num_speculative_tokens=2, max_num_batched_tokens=BS)
    on = build(TINY, weights, enable_prefix_caching=True, num_prefix_snapshots=32, **kw)
    off = build(TINY, weights, enable_prefix_caching=False, **kw)
    prefix = _ids(50, 11)
    greedy(on, [prefix + _ids(4, 12)], 20)
    second = prefix + _ids(4, 13)
    got, got_logits = greedy(on, [second], 20)
    want, want_logits = greedy(off, [second], 20)
    assert on.stats().prefix_cache_hits > 0
    assert got == want
    assert (got_logits[0] - want_logits[0]).abs().max() < TOL


def test_prefix_cache_under_preemption_and_eviction(weights) -> None:
    """Four requests sharing a prefix in a pool that holds about two of them: preemptions, cached blocks evicted
    for running requests, re-admissions that hit their own prefix; every request's tokens equal the no-cache run."""
    prefix = _ids(40, 21)
    prompts = [prefix + _ids(5 + i, 22 + i) for i in range(4)]
    kw = dict(num_kv_blocks=9, max_num_batched_tokens=64)
    on = build(TINY, weights, enable_prefix_caching=True, **kw)
    off = build(TINY, weights, enable_prefix_caching=False, **kw)
    got, got_logits = greedy(on, prompts, 60)
    want, want_logits = greedy(off, prompts, 60)
    s = on.stats()
    assert s.num_preemptions > 0 and s.prefix_cache_hits > 0
    assert s.num_used_blocks == 0 and s.num_free_blocks == 9
    assert got == want
    for g, w in zip(got_logits, want_logits, strict=True):
        assert (g - w).abs().max() < TOL
