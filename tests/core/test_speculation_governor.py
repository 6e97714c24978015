"""The governor pauses drafting while steps with drafts yield slower tokens than steps
without, and tries again after a pause."""

from __future__ import annotations

from vlite.core.speculation_governor import SpeculationGovernor


def test_drafting_goes_on_while_it_yields_tokens_faster():
    governor = SpeculationGovernor(pause_steps=4)
    governor.record(0.010, 1, had_drafts=False)  # 10 ms per token
    for _ in range(10):
        governor.record(0.018, 3, had_drafts=True)  # 6 ms per token
        assert governor.allows_drafts()


def test_slower_drafting_pauses_for_pause_steps_then_is_tried_again():
    governor = SpeculationGovernor(pause_steps=3)
    governor.record(0.010, 1, had_drafts=False)
    governor.record(0.018, 1, had_drafts=True)  # 18 ms per token: slower
    assert not governor.allows_drafts()
    for _ in range(2):
        governor.record(0.010, 1, had_drafts=False)
        assert not governor.allows_drafts()
    governor.record(0.010, 1, had_drafts=False)
    assert governor.allows_drafts()
    assert governor.with_drafts is None  # measured afresh


def test_without_a_measure_of_plain_steps_drafting_is_not_judged():
    governor = SpeculationGovernor(pause_steps=3)
    governor.record(1.0, 1, had_drafts=True)
    assert governor.allows_drafts()


def test_a_step_that_yields_nothing_is_not_counted():
    governor = SpeculationGovernor()
    governor.record(0.5, 0, had_drafts=True)
    assert governor.with_drafts is None
