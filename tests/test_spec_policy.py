"""`SpecPolicy` (engine/speculative.py): a step speculates where E * plain(B) >= (1 + margin) * spec(B), from
measured step costs (fed here by hand: no timing) and the running acceptance."""

from __future__ import annotations

from engine.speculative import SpecPolicy


def _feed(p: SpecPolicy, batch: int, verify: float, draft: float, plain: float, catch_up: float, n: int = 3) -> None:
    for _ in range(n):
        for what, s in (("verify", verify), ("draft", draft), ("plain", plain), ("catch_up", catch_up)):
            p.record(what, batch, s)


def test_it_measures_speculative_then_plain_steps_first() -> None:
    p = SpecPolicy(2)
    for _ in range(3):  # the first sample of each part is dropped: three to keep two
        assert p.speculate(4)
        p.record("verify", 4, 4.0)
        p.record("draft", 4, 1.5)
        p.observe(2, 2)
    assert p.speculate(4)  # E from 3 verified sequences is too rough to turn it off on
    for _ in range(5):
        p.observe(2, 2)
    assert not p.speculate(4)  # then plain steps
    for _ in range(3):
        p.record("plain", 4, 2.0)
        p.record("catch_up", 4, 0.1)
    assert p.expected_tokens() == 3.0
    assert p.speculate(4)  # 3 * 2.1 >= 1.05 * 5.5
    assert p.speculate(5)  # an unmeasured batch size within a quarter: the measured one's costs
    assert p.speculate(1) and p.cost("verify", 1) is None  # not close: measured anew


def test_off_where_it_does_not_pay_probed_until_the_costs_settle() -> None:
    p = SpecPolicy(2, interval=4)
    _feed(p, 8, verify=5.0, draft=2.5, plain=2.0, catch_up=0.1)
    for _ in range(8):
        p.observe(2, 2)
    assert p.expected_tokens() == 3.0
    # 3 * 2.1 < 1.05 * 7.5: off; one step in 4, then in 8, speculates again while the windows are not full
    assert [p.speculate(8) for _ in range(12)] == [False] * 3 + [True] + [False] * 7 + [True]
    _feed(p, 8, verify=5.0, draft=2.5, plain=2.0, catch_up=0.1, n=8)
    # full windows and 7.5 > (k + 1) * 2.1: no acceptance could pay, nothing is probed
    assert not any(p.speculate(8) for _ in range(40))
    _feed(p, 8, verify=3.0, draft=1.0, plain=2.0, catch_up=0.1, n=8)  # cheaper verify steps
    assert p.speculate(8)


def test_nothing_accepted_turns_it_off_before_any_cost() -> None:
    p = SpecPolicy(2)
    p.observe(2, 0)
    assert p.speculate(1)  # one verify step is not enough to tell
    p.observe(2, 0)
    assert [p.speculate(1) for _ in range(32)] == [False] * 31 + [True]  # probed once in 32


def test_always_speculates() -> None:
    p = SpecPolicy(2, "always")
    _feed(p, 1, verify=9.0, draft=9.0, plain=1.0, catch_up=0.0)
    for _ in range(3):
        p.observe(2, 0)
    assert all(p.speculate(1) for _ in range(10))
