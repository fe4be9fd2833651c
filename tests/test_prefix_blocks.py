"""The block pool's prefix cache (engine/kv_cache.py) on its own: chain-hashed blocks, shared reference-counted
blocks, hits only where a slot-state snapshot exists, LRU eviction of free cached blocks only."""

from __future__ import annotations

from engine.kv_cache import BlockManager
from engine.sampler import SamplingParams
from engine.sequence import Sequence


def _seq(name: str, tokens: list[int]) -> Sequence:
    return Sequence(name, tokens, SamplingParams(temperature=0, max_tokens=4))


def _run(bm: BlockManager, seq: Sequence) -> None:
    """As if one step computed all but the last token of `seq` (cached blocks keyed, snapshot at the end)."""
    bm.allocate(seq, seq.num_tokens)
    seq.num_computed_tokens = seq.num_tokens - 1
    bm.cache_full_blocks(seq)


def test_hit_needs_the_blocks_and_a_snapshot_at_their_end() -> None:
    bm = BlockManager(8, 8, 2, enable_prefix_caching=True, num_snapshots=4)
    a = _seq("a", list(range(100, 141)))  # 41 tokens: 5 full blocks computed (40)
    _run(bm, a)
    assert bm.num_cached_blocks == 5
    assert bm.snapshot_for(a, 0) is not None  # boundary 40 = the end of the step
    table = list(a.block_table)
    bm.free(a)
    assert bm.num_free_blocks == 8 and bm.num_used_blocks == 0  # cached blocks are free (evictable)
    b = _seq("b", list(range(100, 133)) + [7, 7, 7])  # shares 33 tokens: blocks 0..3 match, block 4 differs
    assert bm.find_prefix(b) == ([], None)  # no snapshot at 32
    bm.reserve_snapshot(_seq("a2", list(range(100, 141))), 32)
    blocks, snap = bm.find_prefix(b)
    assert blocks == table[:4] and snap is not None
    bm.take_prefix(b, blocks)
    b.num_computed_tokens = 32
    c = _seq("c", list(range(100, 141)))  # all of a: hit at 40 (its snapshot), one token left to compute
    blocks_c, _ = bm.find_prefix(c)
    assert blocks_c == table[:5]
    bm.take_prefix(c, blocks_c)
    assert bm.num_used_blocks == 5  # blocks 0..3 shared by b and c
    bm.free(b)
    assert bm.num_used_blocks == 5  # still c's
    bm.free(c)
    assert bm.num_used_blocks == 0 and bm.num_free_blocks == 8


def test_eviction_takes_uncached_blocks_first_then_least_recently_freed() -> None:
    bm = BlockManager(6, 4, 3, enable_prefix_caching=True, num_snapshots=2)
    a = _seq("a", list(range(1, 10)))  # 2 full blocks of 4 computed
    _run(bm, a)
    bm.snapshot_for(a, 0)
    bm.free(a)  # 2 cached + 1 plain block back
    big = _seq("big", [9] * 12)
    bm.allocate(big, 12)  # 3 blocks without a key first (a's plain third block, never-used ones)
    assert bm.num_cached_blocks == 2 and bm.find_prefix(_seq("a2", list(range(1, 10))))[0]
    bm.allocate(big, 20)  # 2 more: the last block without a key, then the least recently freed cached one
    assert bm.num_cached_blocks == 1
    assert bm.find_prefix(_seq("a3", list(range(1, 10)))) == ([], None)  # block 0's successor evicted first...
    bm.allocate(big, 24)
    assert bm.num_cached_blocks == 0 and bm.num_free_blocks == 0  # ...then block 0: nothing cached is left


def test_running_blocks_are_never_evicted() -> None:
    bm = BlockManager(4, 4, 2, enable_prefix_caching=True, num_snapshots=2)
    a = _seq("a", list(range(1, 10)))
    _run(bm, a)  # 3 blocks in use, 2 of them cached
    other = _seq("o", [5] * 8)
    assert not bm.can_allocate(other, 8)  # only 1 free block: a's cached blocks are not evictable while it runs
    bm.allocate(other, 4)
    assert a.block_table and bm.num_cached_blocks == 2


def test_may_snapshot_is_where_a_step_passed_a_boundary_the_slot_still_holds() -> None:
    """`may_snapshot` (asked before a step's drafts are made, reading nothing cached): True exactly where the step
    from `start` to `end` passed a block boundary P with end - P <= spare - where `snapshot_for` may take one -
    and never with prefix caching off."""
    bm, off = BlockManager(8, 4, 2, enable_prefix_caching=True, num_snapshots=2), BlockManager(8, 4, 2)
    a = _seq("a", list(range(1, 12)))
    seen = set()
    for end in range(1, 11):
        a.num_computed_tokens = end
        for start in range(end):
            for spare in (0, 2):
                p = end // 4 * 4
                want = 0 < p and start < p and end - p <= spare
                assert bm.may_snapshot(a, start, spare) is want and off.may_snapshot(a, start, spare) is False
                seen.add(want)
    assert seen == {False, True}
