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


def test_drafting_at_every_step_is_paused_now_and_then_to_measure_steps_without():
    governor = SpeculationGovernor(probe_every=16, probe_steps=2)
    steps = 0
    while governor.allows_drafts():
        governor.record(0.004, 2, had_drafts=True)
        steps += 1
    assert steps == 16 // 8  # no measure of plain steps yet: the first probe comes early
    for _ in range(2):
        governor.record(0.005, 1, had_drafts=False)
    assert governor.allows_drafts()
    governor.record(0.004, 2, had_drafts=True)  # faster than plain steps: drafting goes on
    steps = 1
    while governor.allows_drafts():
        governor.record(0.004, 2, had_drafts=True)
        steps += 1
    assert steps == 16 and governor.paused_for == 2  # the next probe


def test_a_draft_model_slower_than_plain_steps_is_paused_after_the_first_probe():
    governor = SpeculationGovernor(probe_every=16, probe_steps=2, pause_steps=32)
    while governor.allows_drafts():
        governor.record(0.020, 2, had_drafts=True)  # 10 ms per token
    for _ in range(2):
        governor.record(0.006, 1, had_drafts=False)  # 6 ms per token
    governor.record(0.020, 2, had_drafts=True)
    assert governor.paused_for == 32


def test_each_slower_measure_in_a_row_doubles_the_pause():
    governor = SpeculationGovernor(pause_steps=4, max_pause_steps=16)
    governor.record(0.010, 1, had_drafts=False)
    pauses = []
    for _ in range(4):
        governor.record(0.030, 1, had_drafts=True)  # slower
        pauses.append(governor.paused_for)
        while not governor.allows_drafts():
            governor.record(0.010, 1, had_drafts=False)
    assert pauses == [4, 8, 16, 16]
