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
from engine.llm import SamplingParams, greedy_with_logits
from engine.model import mtp_proposer
from engine.model.attention import Attention

TINY_SPEC = Path(__file__).resolve().parents[2] / "golden" / "tiny-spec"
PROMPTS = [list(range(3, 12)), [7, 300, 41, 2, 2, 9, 13, 600, 5, 8, 21, 34, 55]]
NEW = 24  # past the window (16) and several CSA (4) / HCA (16) blocks
TINY_SPEC_WINDOW = 16


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
        eng = _engine("always")
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


def _engine(policy: str, method: str = "mtp"):
    model = TINY_SPEC if method == "mtp" else TINY_SPEC.with_name("tiny-spec-dspark")
    cfg = EngineConfig.from_model_dir(model, kernels="host", max_num_seqs=2, speculative=method,
                                      num_speculative_tokens=2 if method == "mtp" else None,
                                      enable_prefix_caching=False, speculative_policy=policy)
    return engine.build(cfg)


def test_a_put_off_catch_up_writes_the_catch_ups_ring_rows() -> None:
    """`mtp_fill_ring` (the MTP ring rows of positions whose catch-up was put off, from the held streams) writes
    exactly what the catch-up over those positions wrote: here the prefill's, over a 20-token prompt, whose ring rows
    of the window before the last position come from one fill and the last one's from the block's pass over that row
    alone - bit for bit over the same rows (fewer rows at once round like any other change of a GEMM's row count)."""
    eng = _engine("always")
    eng.add_request(PROMPTS[1] + PROMPTS[0][:7], SamplingParams(temperature=0, max_tokens=4))
    eng.step()  # the prefill, then the MTP block's catch-up over its positions
    run = eng.runner
    seq = next(iter(eng._requests.values()))
    lc = run.cache.layers[run.cfg.n_layers]
    wl, win = lc.win_kv.shape[1], run.cfg.window_size
    pos = torch.arange(20)
    # the ring's rows of the last window (its spare rows past a window hold the drafting recursion's speculative rows)
    last = pos[-win:] % wl
    caught = lc.win_kv[seq.slot, last].clone()
    lc.win_kv[seq.slot].zero_()
    hidden = run._last[1][pos]
    ids = torch.tensor(seq.all_token_ids)[pos + 1]
    for part in (pos[-win:-1], pos[-1:]):  # as the catch-up wrote them
        mtp_proposer.mtp_fill_ring(run.model, run.cache, torch.full_like(part, seq.slot), part, hidden[part],
                                   ids[part])
    assert torch.equal(lc.win_kv[seq.slot, last], caught) and caught.abs().sum() > 0


def test_a_catch_up_runs_the_block_on_each_last_row_and_fills_the_window_before_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A later query of the sliding-only MTP block reads nothing of a final position but its ring row, so a catch-up
    over a 40-token prefill fills the ring rows of the window before its last position (window - 1 of them, none
    older) and runs the block (one `mtp_pass`) over the last row only; its drafts are those of the whole block over
    every position (`_fills_ring` off: the path a sharded block takes) within the golden's fp32 tolerance."""
    prompt = [(7 * i + 3) % 900 + 2 for i in range(40)]

    def catch_up(fills: bool) -> tuple[list, list, list]:
        fills_at, pass_rows = [], []
        real_fill, real_pass = mtp_proposer.mtp_fill_ring, engine.model.model.Transformer.mtp_pass

        def fill(model, cache, slots, pos, hidden, ids):
            fills_at.append(pos.tolist())
            return real_fill(model, cache, slots, pos, hidden, ids)

        def mtp_pass(self, x, next_ids, plan, cache, rows, k=0):
            pass_rows.append(x.shape[0])
            return real_pass(self, x, next_ids, plan, cache, rows, k)

        with monkeypatch.context() as m:
            m.setattr(mtp_proposer, "mtp_fill_ring", fill)
            m.setattr(engine.model.model.Transformer, "mtp_pass", mtp_pass)
            m.setattr(mtp_proposer, "_fills_ring", lambda model: fills)
            eng = _engine("always")
            eng.add_request(prompt, SamplingParams(temperature=0, max_tokens=4))
            eng.step()  # the prefill and its catch-up
        seq = next(iter(eng._requests.values()))
        ring = eng.runner.cache.layers[eng.runner.cfg.n_layers].win_kv[seq.slot].clone()
        return fills_at, pass_rows[:1], [seq.draft_token_ids, ring]

    fills_at, first_pass, (drafts, ring) = catch_up(True)
    win = TINY_SPEC_WINDOW
    assert fills_at == [list(range(40 - win, 39))] and first_pass == [1]
    whole_fills, whole_pass, (whole_drafts, whole_ring) = catch_up(False)
    assert whole_fills == [] and whole_pass == [40] and drafts == whole_drafts and len(drafts) == 2
    rows = torch.arange(40 - win, 40) % ring.shape[0]  # the window's ring rows: the same keys
    assert (ring[rows] - whole_ring[rows]).abs().max() <= FP32_LOGIT_TOL


@pytest.mark.parametrize("method, caching", [("mtp", False), ("mtp", True), ("dspark", False)])  # DSpark: no caching
def test_a_sequences_last_token_runs_no_draft_head_unless_a_prefix_snapshot_keeps_it(method: str,
                                                                                       caching: bool) -> None:
    """After a step that leaves a sequence one token to go (max_tokens), no later draft reads what its draft head
    would write, so the head does not run for it (here: max_tokens 2, after the prefill); unless the step ended on a
    cached block boundary, where the slot state - the draft ring with it - is saved as a prefix snapshot. The tokens
    are the plain engine's either way."""
    model = TINY_SPEC if method == "mtp" else TINY_SPEC.with_name("tiny-spec-dspark")
    plain = engine.build(EngineConfig.from_model_dir(model, kernels="host", max_num_seqs=2,
                                                     enable_prefix_caching=False))
    eng = engine.build(EngineConfig.from_model_dir(model, kernels="host", max_num_seqs=2, speculative=method,
                                                   num_speculative_tokens=2 if method == "mtp" else None,
                                                   enable_prefix_caching=caching))
    bs = eng.config.cache.block_size
    prompt = list(range(3, 3 + 2 * bs))  # the prefill ends on a block boundary
    calls, real = [], eng.runner.draft

    def draft(requests):
        calls.append([(r.start, r.n, r.want) for r in requests])
        return real(requests)

    eng.runner.draft = draft
    outs, _ = greedy_with_logits(eng, [prompt], 2)
    assert outs == greedy_with_logits(plain, [prompt], 2)[0]
    assert calls == ([[(0, 2 * bs, 0)]] if caching else [])  # the catch-up over the prompt, then nothing


@pytest.mark.parametrize("method", ["mtp", "dspark"])
def test_speculation_switched_off_and_on_keeps_the_tokens(monkeypatch: pytest.MonkeyPatch, method: str) -> None:
    """The policy off for three steps, on for one, over and over: the catch-ups (MTP) / context writes (DSpark) put
    off while it is off are resumed (`ModelRunner._resume`), the tokens are the always-speculating engine's, and
    the drafts after a resume are accepted as often as always-on drafts are (a resumed ring with stale rows would
    draft worse)."""
    ref = _engine("always", method)
    ref_out, _ = greedy_with_logits(ref, PROMPTS, NEW)
    eng = _engine("auto", method)
    pattern = iter([False, False, False, True] * 100)
    monkeypatch.setattr(eng.spec_policy, "speculate", lambda batch, seqs=(), waiting=False: next(pattern))
    resumed = []
    real = eng.runner._resume

    def resume(steps, hidden, requests):
        resumed.append(sum(r.slot in eng.runner._behind and not r.defer for r in requests))
        return real(steps, hidden, requests)

    monkeypatch.setattr(eng.runner, "_resume", resume)
    out, _ = greedy_with_logits(eng, PROMPTS, NEW)
    assert out == ref_out
    assert sum(resumed) > 0 and eng.spec_stats.num_drafts > 0
    assert eng.spec_stats.acceptance_rate >= ref.spec_stats.acceptance_rate - 0.1, (eng.spec_stats.to_dict(),
                                                                                      ref.spec_stats.to_dict())


@pytest.mark.parametrize("method", ["mtp", "dspark"])
def test_the_policy_keeps_only_steps_of_k_drafts(monkeypatch: pytest.MonkeyPatch, method: str) -> None:
    """A verify step (and its drafting) where a sequence near its max_tokens had fewer than k drafts reaches the
    policy as a step not to keep (seconds None): fewer rows than the speculative steps it weighs."""
    eng = _engine("always", method)
    k = eng.config.spec.num_speculative_tokens
    drafts, wants, seen = [], [], {"verify": [], "draft": []}
    real_execute, real_draft, real_record = eng.runner.execute, eng.runner.draft, eng.spec_policy.record

    def execute(batch, *args, **kwargs):
        drafts.append([len(s.draft_token_ids) for s, _ in batch])
        return real_execute(batch, *args, **kwargs)

    def draft(requests):
        wants.append([r.want for r in requests])
        return real_draft(requests)

    def record(what, batch, seconds):
        if what in seen:  # whether kept, and whether every sequence had (verify) / wanted (draft) k drafts
            seen[what].append((seconds is not None, min(drafts[-1] if what == "verify" else wants[-1]) == k))
        return real_record(what, batch, seconds)

    monkeypatch.setattr(eng.runner, "execute", execute)
    monkeypatch.setattr(eng.runner, "draft", draft)
    monkeypatch.setattr(eng.spec_policy, "record", record)
    # max_tokens apart: the shorter one's last steps draft fewer than k while the other drafts k
    for prompt, n in zip(PROMPTS, (9, 14), strict=True):
        eng.add_request(prompt, SamplingParams(temperature=0, max_tokens=n))
    while eng.has_unfinished():
        eng.step()
    for what, pairs in seen.items():
        assert all(kept == full for kept, full in pairs), (what, pairs)
        assert {kept for kept, _ in pairs} == {True, False}, (what, pairs)


def _keep_steps(run, method: str, native: bool) -> tuple[list, torch.Tensor, torch.Tensor]:
    """Three steps' rows kept (`ModelRunner._keep`) through the op table's `keep_rows` or (`native` False) the torch
    path, flushed: ([the three steps, what was left pending of them], `_held`, `_held_ids`). Slot 0's ring row 5 is
    kept twice."""
    from engine.model.dspark_proposer import Capture

    cfg = run.cfg

    def step(t: int, seed: int):
        g = torch.Generator().manual_seed(seed)
        if method == "mtp":
            return torch.randn(t, cfg.hc_mult, cfg.dim, generator=g)
        return Capture([torch.randn(t, cfg.hc_mult, cfg.dim, generator=g) for _ in cfg.dspark_target_layer_ids])

    write = run.model.ops.keep_rows
    run.model.ops.keep_rows = write if native else None
    try:
        run._pending.clear()
        first, long, later = step(2, 1), step(40, 2), step(2, 3)
        # row 1 (kept, not overwritten): -0 in every stream, whose sum is +0 (torch's sum starts from 0)
        (first if method == "mtp" else first.streams[0])[1, :, :3] = -0.0
        rows = run._held.shape[1]
        run._keep(first, [5, rows + 5], [0, 1], [11, 12])  # flat held rows: slot * rows + ring row
        pending = [p[0] for p in run._pending]
        run._keep(long, [6], [7], [13])
        pending += [p[0] for p in run._pending[len(pending):]]
        run._keep(later, [5], [1], [14])  # slot 0, ring row 5 again: the later wins
        if run._pending:
            run._flush()
        return [first, long, later, pending], run._held.clone(), run._held_ids.clone()
    finally:
        run.model.ops.keep_rows = write


@pytest.mark.parametrize("method", ["mtp", "dspark"])
def test_held_rows_keep_a_whole_step_by_reference_copy_a_part_and_the_later_row_wins(method: str) -> None:
    """`ModelRunner._keep` / `_flush` (speculation off), the torch path: a decode step's rows are kept as they are
    (no copy), some rows of a longer step are copied (the step is not kept alive), and a (slot, ring row) kept twice
    before a flush holds the later one's rows and id; DSpark's rows are its `Capture`'s context (the hc mean of each
    layer's)."""
    run = _engine("auto", method).runner
    (first, long, later, pending), held, ids = _keep_steps(run, method, native=False)

    def made(src):
        return src if isinstance(src, torch.Tensor) else src.tensor()

    assert pending[0] is first
    kept = pending[1] if isinstance(pending[1], torch.Tensor) else pending[1].streams[0]
    whole = long if isinstance(long, torch.Tensor) else long.streams[0]
    assert kept.untyped_storage().data_ptr() != whole.untyped_storage().data_ptr()  # a copy of row 7
    assert not run._pending
    assert torch.equal(held[0, 5].flatten(), made(later)[1].flatten()) and int(ids[0, 5]) == 14
    assert torch.equal(held[1, 5].flatten(), made(first)[1].flatten()) and int(ids[1, 5]) == 12
    assert torch.equal(held[0, 6].flatten(), made(long)[7].flatten()) and int(ids[0, 6]) == 13
    assert run._held.shape[1] > 6


@pytest.mark.parametrize("method", ["mtp", "dspark"])
def test_the_native_keep_writes_the_torch_paths_held_rows_at_once(method: str) -> None:
    """The host table's `keep_rows` (one native call a step, engine/host_kernels/small_ops.py) writes `_held` and
    `_held_ids` at once, nothing pending, bit for bit what the torch path's `_flush` writes (the hc mean of DSpark's
    capture: the streams summed in torch's order from 0, -0 included, then divided)."""
    run = _engine("auto", method).runner
    assert run.model.ops.keep_rows is not None
    _, want, want_ids = _keep_steps(run, method, native=False)
    run._held.zero_()
    run._held_ids.zero_()
    (_, _, _, pending), held, ids = _keep_steps(run, method, native=True)
    assert pending == []  # written at once
    assert torch.equal(held.view(torch.int32), want.view(torch.int32)) and torch.equal(ids, want_ids)



def test_dspark_off_steps_hold_their_context_from_inside_the_target_layers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Speculation off on the host table: a DSpark decode step's context rows reach `_held` from inside the target
    layers' native attention calls (each averages its input streams into its slice of the row; the fused layer's
    and, once the CSA layers' indexer selects, the attention half's), with no `keep_rows` call of their own, bit for
    bit the rows of the step's `Capture`; MTP (final streams and next ids) keeps them by the call."""
    eng = _engine("auto", "dspark")
    run = eng.runner
    assert run._hold_in_layers is not None and set(run._hold_in_layers[0]) == set(run.cfg.dspark_target_layer_ids)
    monkeypatch.setattr(eng.spec_policy, "speculate", lambda batch, seqs=(), waiting=False: False)
    calls, checked = [0], [0]
    real_keep = run.model.ops.keep_rows

    def keep_rows(*args):
        calls[0] += 1
        return real_keep(*args)

    monkeypatch.setattr(run.model.ops, "keep_rows", keep_rows)
    last, real_hold = [], run.hold

    def hold(decodes):  # the step's rows, before hold lets them go
        last.append(run._last)
        real_hold(decodes)

    monkeypatch.setattr(run, "hold", hold)
    for prompt in PROMPTS:
        eng.add_request(prompt, SamplingParams(temperature=0, max_tokens=NEW))
    eng.step()  # the prefill: its rows kept by the call
    rows = run._held.shape[1]
    while eng.has_unfinished():
        before = calls[0]
        held = len(last)
        eng.step()
        if len(last) == held:  # the last steps: nothing decodes after them, nothing to hold
            continue
        steps, _, capture = last[-1]
        assert run._last is None
        if all(s.n == 1 for s in steps) and len(steps) == len(PROMPTS):
            assert run._held_by_step and calls[0] == before
            want = capture.tensor()
            for j, s in enumerate(steps):
                got = run._held[s.slot, s.start % rows]
                assert torch.equal(got.view(torch.int32), want[j].view(torch.int32)), (s, j)
                checked[0] += 1
    assert checked[0] >= NEW
    assert _engine("auto", "mtp").runner._hold_in_layers is None


@pytest.mark.parametrize("compressed", [False, True])
def test_rope_tables_of_positions_at_once_are_each_parts_own(compressed: bool) -> None:
    """`Rope.cos_sin` over positions back to back, split, is bit for bit `cos_sin` over each part alone: what the
    one-call MTP drafting relies on (its catch-up's and every recursion pass's tables in one call, against each
    pass's own plan's call). torch's float cos / sin run every element through one vector routine, the last
    partial vector included, so an element's value does not depend on the call's shape or its place in it."""
    from engine.config import ModelConfig
    from engine.model.layers import Rope

    rope = Rope(ModelConfig.from_json(TINY_SPEC), compressed)
    g = torch.Generator().manual_seed(0)
    for sizes in ([1], [3, 1], [1, 1, 1], [5, 2, 2], [17, 16], [2, 8, 8, 8], [40, 3, 3, 3]):
        pos = torch.randint(0, 1 << 20, (sum(sizes),), generator=g)
        cos, sin = rope.cos_sin(pos)
        for c, s, part in zip(cos.split(sizes), sin.split(sizes), pos.split(sizes), strict=True):
            ref_cos, ref_sin = rope.cos_sin(part.clone())
            assert torch.equal(c, ref_cos) and torch.equal(s, ref_sin) and c.is_contiguous(), sizes


@pytest.mark.parametrize("compressed", [False, True])
def test_the_drafting_rope_rows_are_each_positions_own(compressed: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The host decoder's RoPE rows for the one-call MTP drafting (`_rope_rows`: a table of `cos_sin` from position
    0, kept and grown by doubling up to ROPE_ROWS positions, past that the positions asked for) hold at row p - p0
    what `cos_sin` of p alone gives, bit for bit; the table is made again for a Rope whose inv_freq is another
    tensor."""
    from engine.config import ModelConfig
    from engine.host_kernels import block_decoder
    from engine.model.layers import Rope

    monkeypatch.setattr(block_decoder, "ROPE_ROWS", 1024)
    rope, dec = Rope(ModelConfig.from_json(TINY_SPEC), compressed), block_decoder.HostBlockDecoder()

    def check(lo: int, hi: int) -> tuple[torch.Tensor, int]:
        cos, sin, p0 = dec._rope_rows(rope, lo, hi)
        assert p0 <= lo and hi <= p0 + cos.shape[0] and cos.shape == sin.shape == (cos.shape[0], rope.inv_freq.shape[0])
        for p in sorted({lo, (lo + hi) // 2, hi - 1}):
            ref_cos, ref_sin = rope.cos_sin(torch.tensor([p]))
            assert torch.equal(cos[p - p0:p - p0 + 1], ref_cos) and torch.equal(sin[p - p0:p - p0 + 1], ref_sin), p
        return cos, p0

    cos, p0 = check(0, 3)
    assert (cos.shape[0], p0) == (256, 0) and check(250, 256)[0] is cos  # kept
    assert check(900, 1000)[0].shape[0] == 1024  # grown to a power of two, at most ROPE_ROWS
    assert check(1020, 1025)[1] == 1020  # past it: the positions themselves, no table kept
    assert dec._rope_rows(rope, 0, 3)[0].shape[0] == 1024
    rope.inv_freq = rope.inv_freq * 2  # another tensor: the table is another one
    again = check(0, 3)[0]
    assert not torch.equal(again[5], cos[5])


def test_one_call_drafting_refuses_a_position_past_its_rope_table() -> None:
    """`mtp_draft` (layer_ops.py) reads RoPE rows at the catch-up's positions and k - 1 past each sequence's last: a
    table that does not cover them (below its first position or past its last) is an IndexError naming it, not a
    read outside it."""
    from engine.host_kernels.layer_ops import mtp_draft

    eng = engine.build(EngineConfig.from_model_dir(TINY_SPEC, kernels="host", speculative="mtp",
                                                   num_speculative_tokens=2))
    m, dec = eng.runner.model, eng.runner.model.ops.block_decoder
    blk, lc = m.mtp[0], eng.runner.cache.layers[m.mtp[0].layer_id]
    packs = (dec._layer_pack(blk, lc), dec._mtp_input_pack(m, blk), dec._lm_head_pack(m, blk, blk.norm))
    x = torch.randn(1, m.cfg.hc_mult, m.cfg.dim)
    cos, sin, _ = dec._rope_rows(blk.attn.rope, 0, 16)
    window = (cos[4:9].contiguous(), sin[4:9].contiguous(), 4)  # positions 4..8
    ids = torch.tensor([5])
    took = mtp_draft(*packs, x, ids, [6], [0], [0], 3, window, blk.attn.win)  # positions 6..8
    if not all(H.max_m(k) >= m.cfg.hc_mult for k in ("mhc", "linear", "fp8", "fp4", "sparse_attn")):
        assert took is None  # the portable build's row limits (0 / 1): the sites decline, nothing is read
        return
    assert took is not None and took[1].shape == (3, 1)
    for at in (7, 3):  # 9 is past the table, 3 before it
        with pytest.raises(IndexError, match="RoPE table"):
            mtp_draft(*packs, x, ids, [at], [0], [0], 3, window, blk.attn.win)
    two = torch.randn(2, m.cfg.hc_mult, m.cfg.dim)
    with pytest.raises(IndexError, match="rows"):  # a last row given twice: refused before anything is read
        mtp_draft(*packs, two, torch.tensor([5, 6]), [5, 6], [0, 0], [1, 1], 2, window, blk.attn.win)
