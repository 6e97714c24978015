"""LeastLoadedRouter's rule, without processes: least loaded wins, ties take turns, and
what happened since a core's last report (sent, ended) is counted exactly once."""

from __future__ import annotations

import pytest

from vlite.engine.core_router import LeastLoadedRouter


def send(router: LeastLoadedRouter, count: int) -> list[int]:
    """Route ``count`` requests one after another, recording each; the cores chosen."""
    chosen = []
    for _ in range(count):
        core = router.choose()
        router.record_sent(core)
        chosen.append(core)
    return chosen


def report(router: LeastLoadedRouter, core: int, load: int) -> None:
    """A question to ``core`` answered at once with ``load`` waiting + running."""
    router.record_question(core)
    router.record_answer(core, load)


def test_equal_cores_take_turns():
    router = LeastLoadedRouter(3)

    # Nothing recorded: every load stays 0, and the cursor still rotates.
    assert [router.choose() for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]


def test_a_burst_between_reports_spreads_over_the_cores():
    router = LeastLoadedRouter(2)

    assert send(router, 8) == [0, 1, 0, 1, 0, 1, 0, 1]
    assert router.loads == [4, 4]


def test_the_least_loaded_core_is_chosen_as_reported():
    router = LeastLoadedRouter(3)
    report(router, 0, 5)
    report(router, 1, 2)
    report(router, 2, 4)

    # Core 1 fills up to core 2's load, then they alternate until both reach core 0's.
    assert send(router, 6) == [1, 1, 2, 1, 2, 0]
    assert router.loads == [6, 5, 6]


def test_requests_sent_after_the_question_are_added_to_the_answer():
    router = LeastLoadedRouter(2)
    router.record_sent(0, 3)
    router.record_question(0)
    router.record_sent(0, 2)  # in flight when the core answered: not in its answer

    router.record_answer(0, 3)

    assert router.loads[0] == 5


def test_requests_that_ended_before_the_answer_are_not_subtracted_twice():
    router = LeastLoadedRouter(2)
    router.record_sent(0, 3)
    router.record_question(0)
    router.record_finished(0)  # its output arrived before the answer: the answer knows

    router.record_answer(0, 2)
    assert router.loads[0] == 2

    router.record_finished(0)  # after the answer: the answer still counted it
    assert router.loads[0] == 1


def test_aborts_count_from_the_question_and_finishes_from_the_answer():
    router = LeastLoadedRouter(2)
    router.record_sent(0, 4)
    router.record_withdrawn(0)  # aborted before the question: not in the answer
    router.record_question(0)
    router.record_withdrawn(0)  # aborted after it: still in the answer

    router.record_answer(0, 3)

    assert router.loads[0] == 2


def test_a_failed_answer_keeps_the_estimate_and_closes_the_question():
    router = LeastLoadedRouter(2)
    router.record_sent(1, 2)
    router.record_question(1)
    assert router.is_awaiting_answer(1)

    router.record_answer(1, None)

    assert not router.is_awaiting_answer(1)
    assert router.loads == [0, 2]


def test_answers_match_their_questions_in_order():
    router = LeastLoadedRouter(1)
    router.record_question(0)
    router.record_sent(0, 2)
    router.record_question(0)
    router.record_sent(0, 1)

    router.record_answer(0, 0)  # the first answer: the 3 sent since are not in it
    assert router.loads == [3]
    router.record_answer(0, 2)  # the second: it counts the 2, not the last one
    assert router.loads == [3]
    router.record_answer(0, 7)  # no open question: ignored
    assert router.loads == [3]


def test_the_estimate_never_goes_below_zero():
    router = LeastLoadedRouter(2)
    report(router, 0, 0)
    router.record_finished(0)  # a late output of a request the answer no longer had

    assert router.loads == [0, 0]


def test_a_router_needs_a_core():
    with pytest.raises(ValueError, match="num_cores=0"):
        LeastLoadedRouter(0)
