"""`SpecPolicy` (engine/speculative.py): a step speculates where E * plain(B) >= (1 + margin) * spec(B), from
step costs fed here by hand (no timing) and the running acceptance; the decisions are asserted."""

from __future__ import annotations

import pytest

from engine.speculative import SpecPolicy, _Costs


def _feed(p: SpecPolicy, batch: int, verify: float, draft: float, plain: float, catch_up: float, n: int = 4) -> None:
    for what, s in (("verify", verify), ("draft", draft), ("plain", plain), ("catch_up", catch_up)):
        for _ in range(n):  # one kind at a time: the first sample after a switch of kind is not kept
            p.record(what, batch, s)


def _accept(p: SpecPolicy, n: int, accepted: int, k: int = 2, seqs: tuple = ()) -> None:
    for i in range(n):
        p.observe(k, accepted, seqs[i % len(seqs)] if seqs else None)


def _set_rates(p: SpecPolicy, rates: list[float]) -> None:
    """The engine's acceptance set outright; observed as a verify is (observe(): the next step works its
    decision out anew, not a settled one)."""
    p.accepted.rates = rates
    p.prior.rates = list(rates)  # and the prior of sequences not seen yet
    p.observe(0, 0)


def test_costs_interpolate_between_measured_batch_sizes() -> None:
    c = _Costs(window=8)
    for b, s in ((1, 1.0), (8, 8.0)):
        for _ in range(3):  # the first at a size is dropped
            c.add(b, s)
    assert c.at(1) == 1.0 and c.at(8) == 8.0
    assert c.at(4) == pytest.approx(4.0)  # between: on the line
    assert c.at(16) == pytest.approx(16.0)  # beyond: the outermost slope
    assert c.near(7, 2) and not c.near(5, 2)


def test_it_measures_speculative_then_plain_steps_first() -> None:
    p = SpecPolicy(2)
    for _ in range(3):  # the first sample of each part is dropped: three to keep two
        assert p.speculate(4)
        p.record("verify", 4, 3.5)
        p.record("draft", 4, 1.5)
        p.observe(2, 2)
    assert p.speculate(4)  # E from 3 verified sequences is too rough to turn it off on
    _accept(p, 5, 2)
    assert not p.speculate(4) and p.why == "measuring a plain step"
    for _ in range(4):  # the first at a new size, and the first after a switch of kind, are not kept
        p.record("plain", 4, 2.0)
        p.record("catch_up", 4, 0.1)
    assert p.expected_tokens() == 3.0
    assert p.speculate(4)  # 3 * 2.1 >= (1 + 0.05 * (1 + log2 4)) * 5


def test_off_and_stays_off_where_not_even_full_acceptance_pays() -> None:
    """Spec steps at 3.6x a plain one with k = 2: no acceptance pays, so nothing is probed (a decided-off state)."""
    p = SpecPolicy(2)
    _feed(p, 8, verify=5.0, draft=2.5, plain=2.0, catch_up=0.1)
    _accept(p, 16, 2)  # every draft accepted: E = 3
    assert not any(p.speculate(8) for _ in range(500))
    assert "not even full acceptance pays" in p.why


def test_on_where_it_wins_and_probed_where_it_loses() -> None:
    p = SpecPolicy(2)
    _feed(p, 1, verify=1.5, draft=1.0, plain=1.2, catch_up=0.1)
    _accept(p, 16, 2)
    assert all(p.speculate(1) for _ in range(50))  # 3 * 1.3 >= 1.05 * 2.5
    _accept(p, 40, 0)  # acceptance falls: E ~ 1.03 (an EMA), then rises a little
    _accept(p, 4, 1)
    gain = p.expected_tokens() * 1.3 / (1.05 * 2.5)
    assert 0.5 < gain < 0.7  # could pay with more acceptance, does not now
    decisions = [p.speculate(1) for _ in range(64)]
    # off; a probe loses 1 - G of a step, so one step in (1 - G) / 0.05 probes E, then the interval doubles
    every = round((1 - gain) / 0.05)
    assert 6 <= every <= 8
    assert [i for i, d in enumerate(decisions) if d] == [every - 1, 3 * every - 1, 7 * every - 1]


def test_a_near_miss_is_probed_sooner() -> None:
    p = SpecPolicy(2)
    _feed(p, 1, verify=1.5, draft=1.0, plain=1.2, catch_up=0.1)
    _accept(p, 16, 0)  # off: next to nothing accepted (probed one step in 32)
    assert not any(p.speculate(1) for _ in range(3))
    _accept(p, 40, 1)  # E ~ 2: G = 2 * 1.3 / (1.05 * 2.5) ~ 0.98, and off it turns on at G >= 1
    assert [p.speculate(1) for _ in range(8)] == [True, False, False, False, True, False, False, False]  # 2, then 4


def test_on_at_batch_1_it_stays_on_through_a_near_miss() -> None:
    """On at batch 1 it stays on down to G = 1 / 1.1 (a running E swings with the text: DSpark's drafts pass or
    fail as a block), off below; off, it turns on again at G >= 1."""
    p = SpecPolicy(2)
    _feed(p, 1, verify=1.5, draft=1.0, plain=1.2, catch_up=0.1)
    _accept(p, 16, 2)
    _set_rates(p, [0.7, 0.5])  # E = 2.2: G = 2.2 * 1.3 / (1.05 * 2.5) = 1.09
    assert p.speculate(1)
    _set_rates(p, [0.55, 0.4])  # G = 0.97: stays on
    assert p.speculate(1) and p.why == "gain 0.97"
    _set_rates(p, [0.45, 0.3])  # G = 0.87: off
    assert not p.speculate(1) and p.why == "gain 0.87"
    _set_rates(p, [0.55, 0.4])  # G = 0.97 again: off still, but for a probe
    assert all(not p.speculate(1) or "probing" in p.why for _ in range(8))
    _set_rates(p, [0.65, 0.45])  # G = 1.04: on
    assert p.speculate(1) and p.why == "gain 1.04"


def test_a_new_batch_size_between_measured_ones_is_not_measured() -> None:
    p = SpecPolicy(2)
    _feed(p, 1, verify=1.5, draft=1.0, plain=1.2, catch_up=0.1)
    _feed(p, 8, verify=5.0, draft=2.0, plain=2.0, catch_up=0.1)
    _accept(p, 16, 2)
    assert p.speculate(1) and not p.speculate(8)
    # B = 3: interpolated, spec 2.5 + 2/7 * 4.5 = 3.79, plain 1.3 + 2/7 * 0.8 = 1.53: G = 3 * 1.53 / (1.05 * 3.79)
    # = 1.15, inside the band, and 3 has no measured size within a quarter: its plain side is measured first
    assert not p.speculate(3) and "measuring plain steps" in p.why
    _feed(p, 3, verify=2.4, draft=1.3, plain=1.5, catch_up=0.1)
    assert p.speculate(3) and p.why.startswith("gain")
    # B = 7: within a quarter of 8, no measuring; spec loses (interpolated costs), and no acceptance pays
    assert not p.speculate(7) and "measuring" not in p.why
    assert p.cost("verify", 7) is None


def test_nothing_accepted_turns_it_off_before_any_cost() -> None:
    p = SpecPolicy(2)
    for _ in range(3):  # up to three verify steps are not enough to tell (a head drafting blocks misses some)
        p.observe(2, 0)
        assert p.speculate(1)
    p.observe(2, 0)
    assert [p.speculate(1) for _ in range(32)] == [False] * 31 + [True]  # probed once in 32


def test_a_head_never_right_is_probed_at_what_a_probe_may_cost() -> None:
    """Nothing accepted where a speculative step is dear (a random head on a wide model: spec(1) = 3.3 plain steps):
    probes come one in (spec(1) - plain(1)) / (2% of a plain step) steps, not one in 32, and the interval doubles on
    from there (a probe that costs 2.3 steps then costs at most 2% of them)."""
    p = SpecPolicy(2)
    _feed(p, 1, verify=3.0, draft=0.3, plain=1.0, catch_up=0.0)
    _accept(p, 4, 0)
    decisions = [p.speculate(1) for _ in range(115 + 230)]
    assert [i for i, d in enumerate(decisions) if d] == [114, 114 + 230], [i for i, d in enumerate(decisions) if d]
    assert "next to nothing accepted" in p.why
    q = SpecPolicy(2)  # off before a plain step was measured (one in 32), the cost known 10 steps later
    for what, s in (("verify", 3.0), ("draft", 0.3)):
        for _ in range(4):
            q.record(what, 1, s)
    _accept(q, 4, 0)
    assert not any(q.speculate(1) for _ in range(10)) and q.interval == 32
    for _ in range(4):
        q.record("plain", 1, 1.0)
    decisions = [q.speculate(1) for _ in range(110)]
    assert [i for i, d in enumerate(decisions) if d] == [104], [i for i, d in enumerate(decisions) if d]


def test_acceptance_is_each_sequences_own() -> None:
    """A batch of sequences whose drafts are rejected is off though the engine's rate (others') is high."""
    p = SpecPolicy(2)
    _feed(p, 2, verify=2.0, draft=1.0, plain=1.2, catch_up=0.1)
    _accept(p, 40, 2, seqs=("a", "b"))
    _accept(p, 20, 0, seqs=("c", "d"))
    assert p.expected_tokens(["a", "b"]) > 2.9 and p.expected_tokens(["c", "d"]) < 1.3
    assert p.speculate(2, ["a", "b"])
    assert not p.speculate(2, ["c", "d"])
    # a sequence with no verify: the engine's prior, a slower average than its rates (the last 20 verifies, all
    # rejected, weigh less in it)
    assert p.expected_tokens() < p.expected_tokens(["e"]) == p.prior.expected(2) < 2.5


def test_a_new_sequences_prior_is_the_engines_longer_run() -> None:
    """The engine's rates follow its last ~10 verifies; a run of full acceptances at the end of one text lifts them,
    not the prior a batch of new sequences starts from: the batch does not turn on (or probe) on that swing."""
    p = SpecPolicy(2, probe_share=1.0)
    _feed(p, 4, verify=2.5, draft=1.5, plain=2.0, catch_up=0.1)
    for i in range(60):
        p.observe(2, 1 if i % 2 else 0, "old")  # E ~ 1.5 over the long run
    for _ in range(10):
        p.observe(2, 2, "old")  # the last few all accepted: the engine's E ~ 2.5
    assert p.expected_tokens() > 2.4 and p.expected_tokens(["x", "y", "z", "w"]) < 1.8
    # G from the prior: 1.78 * 2.1 / (1.15 * 4) = 0.81 (from the engine's rates: 1.14, on for the whole batch)
    assert not p.speculate(4, ["x", "y", "z", "w"]) and not p.probe_one


def test_a_probe_of_a_batch_drafts_for_one_sequence() -> None:
    p = SpecPolicy(2, probe_share=1.0)  # a probe's cost not counted: one in 8
    _feed(p, 4, verify=3.0, draft=1.5, plain=2.0, catch_up=0.1)
    _accept(p, 16, 1, seqs=("a", "b", "c", "d"))  # E = 2: 2 * 2.1 < 1.15 * 4.5, full acceptance would pay
    decisions = [p.speculate(4, ["a", "b", "c", "d"]) for _ in range(16)]
    first = decisions.index(True)
    assert 1 <= first < 8
    p = SpecPolicy(2, probe_share=1.0)  # a probe's cost not counted: one in 8
    _feed(p, 4, verify=3.0, draft=1.5, plain=2.0, catch_up=0.1)
    _accept(p, 16, 1, seqs=("a", "b", "c", "d"))
    for _ in range(first):
        assert not p.speculate(4, ["a", "b", "c", "d"])
    assert p.speculate(4, ["a", "b", "c", "d"]) and p.probe_one and "probing" in p.why
    p.observe(2, 1, "a")
    assert p.pick(["a", "b"]) == "b"  # the fewest verifies of its own


def test_a_batch_of_new_sequences_verifies_at_the_probe_interval() -> None:
    """At B > 1 new sequences' first verify is a probe like any other, at the probe interval, near tie or far off
    (a batch probing at once for each new batch paid a probe, about a plain step, every few dozen steps); at B = 1 a
    new sequence verifies at once."""
    new = ["x", "y", "z", "w"]
    for verify in (2.5, 3.0):  # E = 2: G = 2 * 2.1 / (1.15 * 4) = 0.91, then 0.81
        p = SpecPolicy(2, probe_share=1.0)  # a probe's cost not counted: one in 8
        _feed(p, 4, verify=verify, draft=1.5, plain=2.0, catch_up=0.1)
        _accept(p, 16, 1)
        decisions = [p.speculate(4, new, waiting=True) for _ in range(8)]
        assert decisions.index(True) == 7 and p.probe_one and "probing E" in p.why
    p = SpecPolicy(2)
    _feed(p, 1, verify=4.0, draft=1.5, plain=2.0, catch_up=0.1)
    _accept(p, 16, 1)  # G = 2 * 2.1 / (1.05 * 5.5) = 0.73
    assert p.speculate(1, ["x"]) and "first verify" in p.why


def test_a_probe_keeps_the_probe_interval() -> None:
    """Probes at B > 1 (one sequence each; new sequences' first verifies are probes too) do not restart the doubling
    of the interval: a stream of new batches costs one probe in 8, then 16, ... steps."""
    p = SpecPolicy(2, probe_share=1.0)  # a probe's cost not counted: one in 8
    _feed(p, 4, verify=2.5, draft=1.5, plain=2.0, catch_up=0.1)
    _accept(p, 16, 1)  # near tie: new sequences verify once
    probes = []
    for step in range(64):
        seqs = [f"{step // 16}-{i}" for i in range(4)]  # a new batch every 16 steps
        if p.speculate(4, seqs, waiting=True):
            probes.append(step)
            p.observe(2, 1, p.pick(seqs))
    assert probes[0] == 7 and len(probes) <= 6
    gaps = [b - a for a, b in zip(probes, probes[1:], strict=False)]
    assert gaps == sorted(gaps) and gaps[-1] >= 16


def test_always_speculates() -> None:
    p = SpecPolicy(2, "always")
    _feed(p, 1, verify=9.0, draft=9.0, plain=1.0, catch_up=0.0)
    _accept(p, 3, 0)
    assert all(p.speculate(1) for _ in range(10))


def test_an_unmeasured_batch_sizes_spec_cost_comes_from_the_draft_rows() -> None:
    """Measured at B = 1 (both sides) and plain at B = 8 only: spec(8) = plain(8) + 8 x the draft rows' cost per
    sequence (verify(1) - plain(1)) + drafting's share of a plain step (draft(1) / plain(1)) - no spec step at 8."""
    p = SpecPolicy(2)
    _feed(p, 1, verify=1.5, draft=1.0, plain=1.2, catch_up=0.1)
    for what, s in (("plain", 2.0), ("catch_up", 0.1)):
        for _ in range(4):
            p.record(what, 8, s)
    spec, plain = p.estimate(8)
    assert plain == pytest.approx(2.1) and spec == pytest.approx(2.0 + 8 * 0.3 + 2.0 / 1.2)
    _accept(p, 16, 2)  # E = 3, and still (k + 1) * 2.1 < (1 + 0.05 * (1 + log2 8)) * 6.07
    assert not any(p.speculate(8) for _ in range(100)) and p.cost("verify", 8) is None
    assert "not even full acceptance pays" in p.why


def test_a_spec_part_measured_near_the_batch_size_is_taken_as_measured() -> None:
    """Verify steps measured at B = 8 but drafting not (a batch's first speculative steps: the first of each kind
    is not kept): spec(8) is batch 8's verify cost plus drafting's fitted share, not the line from batch 1's draft
    rows (3 rows of one sequence cost little more than 1; 8 x 3 rows cost far more than 8), so batch 8 stays off;
    one kept sample of each part at 8 is taken over the fit."""
    p = SpecPolicy(2)
    _feed(p, 1, verify=1.15, draft=0.3, plain=1.2, catch_up=0.05)  # batch 1: a verify costs a plain step
    for what, s in (("plain", 2.0), ("catch_up", 0.05)):
        for _ in range(4):
            p.record(what, 8, s)
    for s in (9.0, 6.0):  # the first is not kept: one sample
        p.record("verify", 8, s)
    p.record("draft", 8, 1.0)  # one draft step at 8: not kept
    spec, plain = p.estimate(8)
    assert plain == pytest.approx(2.05) and spec == pytest.approx(6.0 + 0.3 / 1.2 * 2.0)
    _accept(p, 16, 2)  # E = 3: 3 * 2.05 < 1.2 * 6.5, not even full acceptance pays
    assert not any(p.speculate(8, [f"s{i}" for i in range(8)]) for _ in range(50))
    p.record("draft", 8, 1.5)
    assert p.estimate(8)[0] == pytest.approx(7.5)  # one kept sample of each part at 8


def test_probes_of_a_batch_cost_a_share_of_its_steps() -> None:
    """At B > 1 probes come one in ceil((spec(1) - plain(1)) / (plain(B) x probe_share)) steps (a probe pays one
    sequence's draft rows and drafting), not one in 8, doubling on; batch 1's probe interval is its own."""
    p = SpecPolicy(2)
    _feed(p, 1, verify=1.5, draft=1.0, plain=1.2, catch_up=0.0)
    _feed(p, 8, verify=5.0, draft=2.0, plain=4.0, catch_up=0.0)  # a tie at full acceptance: never decided off
    _accept(p, 16, 1)  # E = 2: G at 8 = 2 * 4 / (1.2 * 7) = 0.95 (a near tie: within the band)
    assert p._probe_steps(8) == 17  # (2.5 - 1.2) / (4 * 0.02) = 16.25
    decisions = [p.speculate(8, waiting=True) for _ in range(60)]
    assert [i for i, d in enumerate(decisions) if d] == [16, 50]  # after 17 off steps, then 34
    assert not p.speculate(1) and p.interval != 68  # batch 1: its own interval
    assert not p.speculate(8, waiting=True) and p.interval == 68


def test_off_at_a_batch_near_a_tie_the_next_steps_take_the_decision_as_it_is() -> None:
    """Off at B = 4 at G = 0.95 (not far off): the steps up to the next probe take the decision without working it out
    (as far off ones do: at B > 1 it turns on again only past the hysteresis), so cheaper plain samples move nothing
    until a verify makes the next step work it out anew."""
    p = SpecPolicy(2, margin=0.0)
    _feed(p, 4, verify=3.0, draft=1.0, plain=2.0, catch_up=0.0)
    _accept(p, 16, 0)
    _set_rates(p, [0.5, 0.4])  # E = 1.9: G = 1.9 * 2 / 4 = 0.95
    assert not p.speculate(4) and p.why == "gain 0.95"
    for _ in range(4):
        p.record("plain", 4, 3.0)  # plain(4) 2.5 now: worked out, G 1.19, past the hysteresis
    assert not any(p.speculate(4) for _ in range(4)) and p.why == "gain 0.95"  # taken as it was
    p.observe(2, 1)  # a verify (a sampled request's): worked out anew
    p.speculate(4)
    assert p.why != "gain 0.95"


def test_on_again_at_a_batch_rests_on_its_own_sequences_acceptance() -> None:
    """Off at B = 4, then the engine's acceptance (other sequences') says it would pay: the batch's sequences, none
    verified yet, verify one at a time first, each at the probe interval (a probe's cost); on once half of them
    have, and their own acceptance says so."""
    batch = ["a", "b", "c", "d"]
    p = SpecPolicy(2, margin=0.0, probe_share=1.0)  # a probe's cost not counted: one in 8
    _feed(p, 4, verify=3.0, draft=1.0, plain=2.0, catch_up=0.0)
    _accept(p, 16, 0, seqs=("x",))  # another sequence: E ~ 1.2, G = 0.6
    assert not p.speculate(4, waiting=True)
    _set_rates(p, [0.9, 0.8])  # the engine's: E = 2.7, G = 1.35
    decisions = []
    for _ in range(32):
        decisions.append((p.speculate(4, batch, waiting=True), p.probe_one))
        if p.probe_one:
            p.observe(2, 2, p.pick(batch))
    probes = [i for i, d in enumerate(decisions) if d == (True, True)]
    assert len(probes) == 2 and probes[0] >= 6 and probes[1] - probes[0] >= 8, decisions
    assert decisions[probes[1] + 1] == (True, False)  # half verified, their E 3: on for the whole batch


def test_a_batch_size_seen_first_starts_as_the_nearest_one_was() -> None:
    """Off at B = 8; a batch of 7 (one sequence finished) at G = 1.05 stays off (the hysteresis of an off size),
    where a size with no size seen before goes on at G >= 1."""
    p = SpecPolicy(2, margin=0.0)
    _feed(p, 8, verify=3.0, draft=1.0, plain=2.0, catch_up=0.0)
    _feed(p, 7, verify=3.0, draft=1.0, plain=2.0, catch_up=0.0)
    _accept(p, 16, 0)
    assert not p.speculate(8)
    _set_rates(p, [0.6, 0.5])  # E = 2.1: G = 1.05
    assert not p.speculate(7)
    q = SpecPolicy(2, margin=0.0)
    _feed(q, 7, verify=3.0, draft=1.0, plain=2.0, catch_up=0.0)
    _accept(q, 16, 1)  # E = 2: G = 1.0
    assert q.speculate(7)


def test_on_at_a_batch_for_long_its_plain_steps_are_measured_again() -> None:
    """On at B = 4 on a plain cost measured long ago: after `refresh` decisions with no plain step at 4, three plain
    steps (the first not kept) measure it again, its old samples dropped; here it is dearer no more, so it turns off."""
    p = SpecPolicy(2)
    _feed(p, 4, verify=3.0, draft=1.0, plain=2.0, catch_up=0.0)
    _accept(p, 16, 2)  # E = 3: G = 3 * 2 / (1.15 * 4) = 1.30
    decisions = [p.speculate(4, waiting=True) for _ in range(p.refresh + 1)]
    assert all(decisions[:-1]) and not decisions[-1] and "measured again" in p.why
    assert p.cost("plain", 4) is None
    assert [p.speculate(4, waiting=True) for _ in range(2)] == [False, False]  # the other two plain steps
    for _ in range(3):
        p.record("plain", 4, 1.2)
    assert not p.speculate(4, waiting=True) and p.why.startswith("gain 0.78")


def test_a_spec_cost_measured_at_another_size_only_is_not_taken_for_this_ones() -> None:
    """Speculative steps measured at B = 1 only (an `always` start), plain ones at B = 8 only: no size has both
    sides, so spec(8) is not read off batch 1's (a verify of 8 x 3 rows costs far more than one of 3): batch 8
    measures its own speculative steps first. A larger size's spec cost is taken as a smaller one's bound."""
    p = SpecPolicy(2)
    for what, s in (("verify", 1.5), ("draft", 1.0)):
        for _ in range(4):
            p.record(what, 1, s)
    for what, s in (("plain", 2.0), ("catch_up", 0.1)):
        for _ in range(4):
            p.record(what, 8, s)
    _accept(p, 16, 2)
    assert p.estimate(8) == (None, pytest.approx(2.1))
    assert p.speculate(8) and p.why == "measuring a speculative step" and not p.probe_one
    q = SpecPolicy(2)  # speculative steps at 8, plain ones at 1: a smaller size's spec cost is bounded by 8's
    for what, s, b in (("verify", 5.0, 8), ("draft", 2.0, 8), ("plain", 1.2, 1), ("catch_up", 0.0, 1)):
        for _ in range(4):
            q.record(what, b, s)
    assert q.estimate(6)[0] == pytest.approx(7.0) and q.estimate(16)[0] is None


def test_a_batch_size_that_was_off_turns_on_only_past_the_hysteresis() -> None:
    for batch, on in ((8, False), (1, True)):
        p = SpecPolicy(2, margin=0.0)
        _feed(p, batch, verify=3.0, draft=1.0, plain=2.0, catch_up=0.0)
        _accept(p, 16, 0)  # E ~ 1.2: G = 0.6
        assert not p.speculate(batch)
        _set_rates(p, [0.6, 0.45])  # E = 2.05: G = 2.05 * 2 / 4 = 1.025
        decisions = [p.speculate(batch) for _ in range(5)]
        assert all(decisions) if on else not any(decisions)  # B > 1 needs G >= 1.1 (no probe within 5 steps)
        _set_rates(p, [0.7, 0.6])  # E = 2.3: G = 1.15
        assert p.speculate(batch)


def test_far_off_at_a_batch_size_is_settled_until_the_next_probe() -> None:
    """B > 1 and G far below 1: the steps before the next probe take the decision as it is (no estimate worked
    out; costs that change meanwhile are not seen, up to `recheck` steps), and a verify ends the settling."""
    p = SpecPolicy(2, probe_share=1.0)  # a probe's cost not counted: one in 8
    _feed(p, 4, verify=3.0, draft=1.5, plain=2.0, catch_up=0.1)
    _accept(p, 16, 1)  # E = 2: G = 0.81, full acceptance would pay (not decided off)
    assert not p.speculate(4, waiting=True) and p._settled is not None
    _feed(p, 4, verify=2.0, draft=0.1, plain=2.0, catch_up=0.1, n=16)  # now speculation would pay
    decisions = [p.speculate(4, waiting=True) for _ in range(7)]
    assert decisions == [False] * 6 + [True] and not p.probe_one  # settled; the 8th step works it out: on
    _feed(p, 4, verify=3.0, draft=1.5, plain=2.0, catch_up=0.1, n=16)
    assert not p.speculate(4, waiting=True) and p._settled is not None
    p.observe(2, 1, "a")
    assert p._settled is None


def test_a_decided_off_batch_size_is_rechecked_every_few_steps() -> None:
    """Decided off at B (not even full acceptance pays): the next `recheck` - 1 steps at B take that decision as it
    is (no estimate worked out), the one after works it out again; another batch size works it out at once."""
    p = SpecPolicy(2)
    _feed(p, 8, verify=5.0, draft=2.5, plain=2.0, catch_up=0.1)
    _accept(p, 16, 2)
    assert not p.speculate(8)
    _feed(p, 8, verify=2.0, draft=0.1, plain=2.0, catch_up=0.1, n=16)  # now speculation would pay
    assert not any(p.speculate(8) for _ in range(p.recheck - 1))
    assert p.speculate(8)  # worked out again
    _feed(p, 8, verify=5.0, draft=2.5, plain=2.0, catch_up=0.1, n=16)
    assert not p.speculate(8)
    _feed(p, 7, verify=2.0, draft=0.1, plain=2.0, catch_up=0.1, n=16)
    assert p.speculate(7)  # another size: not the settled decision


def test_a_step_with_no_decoding_sequence_decides_nothing() -> None:
    """A step of prefill chunks only (batch 0) asks too: no decision and no state moved - even where speculative
    steps were measured only as probes (verify costs, no draft cost yet), which once made the estimate add a
    missing cost (a TypeError out of the engine loop)."""
    p = SpecPolicy(2)
    for what in ("verify", "plain", "catch_up"):  # at batch 1 a probe's drafting is not recorded: no "draft" cost
        for _ in range(4):
            p.record(what, 1, 1.0 if what == "verify" else 0.5)
    _accept(p, 10, 1, seqs=("a",))
    assert p.estimate(0) == (None, p.estimate(0)[1])
    before = (p._t, p.interval, p.off_steps, p.why)
    assert p.speculate(0, []) is False
    assert (p._t, p.interval, p.off_steps, p.why) == before
    assert p.speculate(1, ["a"])  # batch 1 still works its decision out (no drafting cost yet: measured first)


def test_a_larger_batch_size_measures_its_plain_steps_before_anything_turns_on() -> None:
    """Plain steps measured at B = 1 and 2 only: plain(8) on their line overshoots (a step's fixed share), so the
    gain at 8 looks like a win. At B > 1 nothing turns on or probes before plain steps near B are measured (the off
    state: the cheap side), and the gain from them decides."""
    p = SpecPolicy(2)
    _feed(p, 1, verify=1.5, draft=0.4, plain=1.2, catch_up=0.0)
    _feed(p, 2, verify=2.0, draft=0.5, plain=1.6, catch_up=0.0)
    for what, s in (("verify", 5.0), ("draft", 1.5)):
        for _ in range(4):
            p.record(what, 8, s)
    _accept(p, 16, 2)  # E = 3; plain(8) on the line: 1.2 + 7 * 0.4 = 4.0, G = 3 * 4 / (1.2 * 6.5) = 1.54
    assert p.estimate(8) == (pytest.approx(6.5), pytest.approx(4.0))
    assert not p.speculate(8, waiting=True) and p.why == "measuring plain steps at this batch size"
    for _ in range(3):  # the first at a new size is not kept
        p.record("plain", 8, 2.0)
    assert not p.speculate(8, waiting=True) and p.why.startswith("gain 0.77")  # 3 * 2 / (1.2 * 6.5)
    assert p.speculate(1)  # B = 1 is measured: 3 * 1.2 / (1.05 * 1.9) = 1.80


def test_a_step_of_fewer_drafts_is_not_kept_and_counts_as_the_first_after_a_switch() -> None:
    """The engine passes None for a verify / draft step where a sequence had fewer than k drafts (near its
    max_tokens): its rows are fewer than a speculative step's, so the policy keeps only the steps it weighs."""
    p = SpecPolicy(2)
    for _ in range(3):
        p.record("plain", 8, 2.0)
    p.record("verify", 8, None)  # the first verify after plain steps, and the first at 8: neither kept
    p.record("verify", 8, 6.0)  # so this one is
    p.record("verify", 8, None)
    p.record("verify", 8, 6.0)
    assert list(p.parts["verify"].samples[8]) == [6.0, 6.0]
    p.record("plain", 8, 9.0)  # a switch back: not kept
    assert p.cost("plain", 8) == 2.0


def test_spec_steps_at_a_batch_size_are_weighed_against_the_plain_steps_of_their_time() -> None:
    """Verify and draft steps at B are kept over the plain step's cost at B when they ran, so a machine that has
    since become slower (or faster) moves both sides alike: no gain appears from the swing alone."""
    p = SpecPolicy(2)
    for what, s in (("plain", 1.0), ("catch_up", 0.0), ("verify", 2.5), ("draft", 0.5)):
        for _ in range(4):
            p.record(what, 8, s)
    assert p.estimate(8) == (3.0, 1.0)
    for _ in range(17):  # slower by half: 16 new plain samples (and the first after the switch, not kept)
        p.record("plain", 8, 1.5)
    assert p.estimate(8) == (pytest.approx(4.5), 1.5)  # (2.5 + 0.5) / 1.0 of the plain step, now 1.5
    assert p.cost("verify", 8) == 2.5  # the seconds as they were kept


def test_a_batch_with_nothing_waiting_weighs_its_slow_sequences() -> None:
    """Half the batch's drafts pass (E 3), half fail (E 1). With requests waiting (a sequence that finishes early
    gives its slot to one) a step is worth the mean E, 2, and it speculates; with nothing waiting the batch runs as
    long as its slowest sequences: the harmonic mean, 1.5, and off. The harmonic mean carries the spread the
    margin's log2 B term stands for with the mean: with nothing waiting the margin is the base 0.05."""
    p = SpecPolicy(2)
    _feed(p, 4, verify=2.5, draft=0.5, plain=2.0, catch_up=0.0)
    _accept(p, 40, 2, seqs=("a", "b"))
    _accept(p, 40, 0, seqs=("c", "d"))
    seqs = ["a", "b", "c", "d"]
    assert p.expected_tokens(seqs) == pytest.approx(2.0, abs=0.03)
    assert p.expected_tokens(seqs, harmonic=True) == pytest.approx(1.5, abs=0.03)
    assert p.speculate(4, seqs, waiting=True)  # G = 2 * 2 / (1.15 * 3) = 1.16
    assert not p.speculate(4, seqs)  # G = 1.5 * 2 / (1.05 * 3) = 0.95
    q = SpecPolicy(2)
    _feed(q, 4, verify=3.1, draft=0.5, plain=2.0, catch_up=0.0)
    _accept(q, 40, 1, seqs=seqs)  # E = 2 for each
    assert q.speculate(4, seqs)  # G = 2 * 2 / (1.05 * 3.6) = 1.06
    assert not q.speculate(4, seqs, waiting=True)  # with the log2 term: 2 * 2 / (1.15 * 3.6) = 0.97
