"""Property tests of the block pool and the scheduler, driven by a tensor-free simulated runner."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.config import CacheConfig
from engine.kv_cache import BlockManager
from engine.sampler import SamplingParams
from engine.scheduler import RequestRejected, Scheduler
from engine.sequence import Sequence, SequenceStatus

FAST = settings(max_examples=80, deadline=None)


# ---- BlockManager -------------------------------------------------------------------------------------------------
def _seq(i: int, n: int = 1, max_tokens: int = 4) -> Sequence:
    return Sequence(str(i), [1] * n, SamplingParams(temperature=0, max_tokens=max_tokens), order=i)


@FAST
@given(num_blocks=st.integers(1, 24), block_size=st.sampled_from([1, 4, 16]), max_num_seqs=st.integers(1, 6),
       ops=st.lists(st.tuples(st.integers(0, 7), st.integers(0, 120), st.booleans()), max_size=60))
def test_block_manager_conserves_blocks_and_slots(num_blocks, block_size, max_num_seqs, ops):
    bm = BlockManager(num_blocks, block_size, max_num_seqs)
    seqs = [_seq(i) for i in range(8)]
    for i, num_tokens, do_free in ops:
        s = seqs[i]
        if do_free:
            bm.free(s)
            assert s.block_table == [] and s.slot is None
        elif bm.can_allocate(s, num_tokens):
            bm.allocate(s, num_tokens)
            assert len(s.block_table) >= bm.num_blocks_for(num_tokens)
        else:
            with pytest.raises(RuntimeError):
                bm.allocate(s, num_tokens)
        tables = [b for s2 in seqs for b in s2.block_table]
        assert len(tables) == len(set(tables)) == bm.num_used_blocks  # no block shared, none lost
        assert bm.num_free_blocks + bm.num_used_blocks == num_blocks
        assert 0.0 <= bm.usage <= 1.0
        slots = [s2.slot for s2 in seqs if s2.slot is not None]
        assert len(slots) == len(set(slots)) == bm.num_used_slots <= max_num_seqs
        assert bm.num_free_slots + bm.num_used_slots == max_num_seqs
    for s in seqs:
        bm.free(s)
    assert bm.num_free_blocks == num_blocks and bm.num_free_slots == max_num_seqs and bm.usage == 0.0


def test_block_manager_arithmetic():
    bm = BlockManager(4, 16, 2)
    assert [bm.num_blocks_for(n) for n in (1, 16, 17, 64, 65)] == [1, 1, 2, 4, 5]
    assert bm.can_ever_fit(64) and not bm.can_ever_fit(65)
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(0, 16, 2)


# ---- Scheduler ----------------------------------------------------------------------------------------------------
configs = st.builds(
    lambda bs, nb, ns, extra, mml: CacheConfig(max_num_seqs=ns, max_num_batched_tokens=ns + extra,
                                                   num_kv_blocks=nb, block_size=bs, max_model_len=mml),
    st.sampled_from([1, 2, 4, 16]), st.integers(1, 24), st.integers(1, 6), st.integers(0, 60), st.integers(4, 200))
requests = st.lists(st.tuples(st.integers(0, 30), st.integers(1, 60), st.integers(1, 25),
                              st.one_of(st.none(), st.integers(0, 60))), min_size=1, max_size=12)


def _check_invariants(sched: Scheduler, batch, all_seqs) -> None:
    cfg, bm = sched.config, sched.block_manager
    assert batch.num_batched_tokens <= cfg.max_num_batched_tokens
    assert batch.num_seqs <= cfg.max_num_seqs and len(sched.running) <= cfg.max_num_seqs
    seqs = [s for s, _ in batch.entries]
    assert len(set(map(id, seqs))) == len(seqs)
    for s, n in batch.entries:
        assert s.status is SequenceStatus.RUNNING and n >= 1
        assert s.num_computed_tokens + n <= s.num_tokens
        assert len(s.block_table) * cfg.block_size >= s.num_computed_tokens + n
    slots = [s.slot for s in sched.running]
    assert None not in slots and len(set(slots)) == len(slots)
    held = [b for s in all_seqs for b in s.block_table]
    assert len(held) == len(set(held)) == bm.num_used_blocks  # blocks conserved, never shared
    assert bm.num_free_blocks + bm.num_used_blocks == cfg.num_kv_blocks
    for s in all_seqs:
        if s.status is not SequenceStatus.RUNNING:  # waiting (incl. preempted) and finished hold nothing
            assert s.block_table == [] and s.slot is None
    for s in batch.preempted:
        assert s.status is SequenceStatus.WAITING and s.num_computed_tokens == 0
    # Work-conserving: with work queued, something runs.
    assert not batch.is_empty or not sched.has_unfinished()


def simulate(cfg: CacheConfig, reqs, max_steps: int = 20_000):
    """Drive the scheduler like the engine does. Returns (sequences, admission step per order, steps)."""
    sched = Scheduler(cfg)
    seqs: list[Sequence] = []
    admitted: dict[int, int] = {}
    pending = sorted(enumerate(reqs), key=lambda x: (x[1][0], x[0]))
    step = 0
    while step < max_steps:
        while pending and pending[0][1][0] <= step:
            i, (_, plen, max_tokens, _) = pending.pop(0)
            seq = Sequence(str(i), [7] * plen, SamplingParams(temperature=0, max_tokens=max_tokens),
                           order=len(seqs))
            seq.abort_step = reqs[i][3]  # type: ignore[attr-defined]
            try:
                sched.add(seq)
            except RequestRejected as e:
                total = plen + max_tokens
                if total > cfg.max_model_len:
                    assert "exceeds the maximum context length" in str(e)
                else:
                    assert sched.block_manager.num_blocks_for(total) > cfg.num_kv_blocks
                    assert "num_kv_blocks" in str(e)
                continue
            seqs.append(seq)
        for s in seqs:
            if s.abort_step is not None and s.abort_step <= step and not s.is_finished:  # type: ignore[attr-defined]
                sched.finish(s, "abort")
        if not pending and not sched.has_unfinished():
            break
        batch = sched.schedule()
        _check_invariants(sched, batch, seqs)
        for s in sched.running:
            admitted.setdefault(s.order, step)
        sample = batch.sample_indices
        sched.advance(batch)
        for i in sample:
            s = batch.entries[i][0]
            s.append_token(3)
            if s.num_output_tokens >= s.sampling_params.max_tokens:
                sched.finish(s, "length")
        step += 1
    return sched, seqs, admitted, step


@FAST
@given(cfg=configs, reqs=requests)
def test_scheduler_invariants_and_every_request_finishes(cfg, reqs):
    sched, seqs, admitted, steps = simulate(cfg, reqs)
    assert not sched.has_unfinished(), f"unfinished after {steps} steps: {sched.running + sched.waiting}"
    for s in seqs:
        assert s.is_finished
        assert s.finish_reason == "abort" or s.num_output_tokens == s.sampling_params.max_tokens
    bm = sched.block_manager
    assert bm.num_free_blocks == cfg.num_kv_blocks and bm.num_free_slots == cfg.max_num_seqs
    # FIFO admission (no overtaking): the first admission of a request never precedes an older one's.
    orders = sorted(admitted)
    assert [admitted[o] for o in orders] == sorted(admitted[o] for o in orders)


def test_request_waits_while_pool_is_full_then_runs():
    cfg = CacheConfig(max_num_seqs=4, max_num_batched_tokens=64, num_kv_blocks=4, block_size=16, max_model_len=64)
    sched = Scheduler(cfg)
    a, b, c = _seq(0, n=48, max_tokens=8), _seq(1, n=40, max_tokens=8), _seq(2, n=4, max_tokens=4)
    for s in (a, b, c):
        sched.add(s)
    batch = sched.schedule()
    assert batch.entries == [(a, 48), (b, 16)]  # b gets the one block left for a 16-token chunk; c waits
    assert sched.block_manager.num_free_blocks == 0 and sched.block_manager.usage == 1.0
    assert sched.waiting == [c]
    sched.advance(batch)
    a.append_token(5)
    # a's decode needs a 4th block: the newer b is preempted (recompute) and requeued ahead of c.
    batch = sched.schedule()
    assert batch.entries == [(a, 1)]
    assert batch.preempted == [b] and b.status is SequenceStatus.WAITING and b.block_table == [] and b.slot is None
    assert sched.waiting == [b, c] and sched.num_preemptions == 1 and sched.take_freed_slots() == [1]
    sched.advance(batch)
    a.append_token(5)
    sched.finish(a, "length")
    assert sched.block_manager.num_free_blocks == 4
    batch = sched.schedule()
    assert [s for s, _ in batch.entries] == [b, c] and batch.entries[0] == (b, 40)


def test_rejections_say_why():
    sched = Scheduler(CacheConfig(max_num_seqs=2, max_num_batched_tokens=8, num_kv_blocks=2, block_size=4,
                                      max_model_len=64))
    with pytest.raises(RequestRejected, match="exceeds the maximum context length max_model_len=64"):
        sched.check_request(60, 10)
    with pytest.raises(RequestRejected, match="num_kv_blocks=2"):
        sched.check_request(8, 1)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        CacheConfig(max_num_seqs=8, max_num_batched_tokens=4)
    capped = Scheduler(CacheConfig(max_num_seqs=2, max_num_batched_tokens=8, num_kv_blocks=16, block_size=4,
                                   max_model_len=64, max_input_len=20))
    capped.check_request(20, 40)  # the longest prompt it was sized for, any output up to max_model_len
    with pytest.raises(RequestRejected, match="prompt \\(21 tokens\\) exceeds max_input_len=20"):
        capped.check_request(21, 1)
    with pytest.raises(ValueError, match="max_input_len must be an int in \\[0, max_model_len=64\\]"):
        CacheConfig(max_model_len=64, max_input_len=65)
