"""The draft budget trims each proposal to the drafts that yield the most tokens a second,
from measured step costs and each request's measured acceptance."""

from __future__ import annotations

import pytest

from vlite.core.draft_budget import DECAY, PRIOR_KEPT, PRIOR_REJECTED, Acceptance, DraftBudget
from vlite.core.outputs import EngineCoreOutput

DRAFTS = [11, 12, 13, 14]


def measured(seconds_of) -> DraftBudget:
    """A budget that has seen decode-only steps of 1 to 40 tokens cost ``seconds_of(T)``."""
    budget = DraftBudget()
    for tokens in range(1, 41):
        budget.observe_step(tokens, seconds_of(tokens))
    return budget


def verify(budget: DraftBudget, request_id: str, drafts: list[int], num_kept: int) -> None:
    new_tokens = [*drafts[:num_kept], 99]
    budget.observe_outputs({request_id: drafts}, [EngineCoreOutput(request_id, new_tokens)])


def linear(tokens: int) -> float:
    """A host where a token more costs a third of a one-token step (6 ms + 2 ms a token)."""
    return 0.004 + 0.002 * tokens


def test_before_any_step_is_measured_every_proposal_is_taken_whole():
    assert DraftBudget().choose({"a": DRAFTS, "b": [5]}, 2) == {"a": DRAFTS, "b": [5]}


def test_acceptance_counts_kept_drafts_and_one_rejection_per_verification():
    acceptance = Acceptance()
    assert acceptance.rate == pytest.approx(PRIOR_KEPT / (PRIOR_KEPT + PRIOR_REJECTED))
    acceptance.observe(4, 2)
    assert acceptance.kept == pytest.approx(DECAY * PRIOR_KEPT + 2)
    assert acceptance.rejected == pytest.approx(DECAY * PRIOR_REJECTED + 1)
    acceptance.observe(3, 3)  # all kept: no rejection
    assert acceptance.rejected == pytest.approx(DECAY * (DECAY * PRIOR_REJECTED + 1))


def test_a_request_whose_drafts_are_kept_verifies_more_of_them_than_one_whose_are_not():
    budget = measured(linear)
    for _ in range(8):
        verify(budget, "copying", DRAFTS, 4)
        verify(budget, "writing", DRAFTS, 0)
    chosen = budget.choose({"copying": DRAFTS}, 1)
    assert chosen == {"copying": DRAFTS}
    assert budget.choose({"writing": DRAFTS}, 1) == {"writing": []}


def test_the_prior_takes_a_few_drafts_beside_one_decode():
    # p = 0.6: the first draft yields 0.6 token for a third of a step, the fourth 0.13.
    chosen = measured(linear).choose({"new": DRAFTS}, 1)["new"]
    assert 1 <= len(chosen) < len(DRAFTS)


def test_beside_many_decodes_only_drafts_kept_almost_surely_pay():
    budget = measured(linear)  # 30 decodes: 64 ms; a token more: 2 ms, a 32nd of the step
    for _ in range(10):
        verify(budget, "sure", DRAFTS, 4)
    assert budget.choose({"new": DRAFTS}, 30) == {"new": []}
    assert budget.choose({"sure": DRAFTS}, 30) == {"sure": DRAFTS}


def test_a_shadow_draft_that_comes_true_brings_drafting_back():
    budget = measured(linear)
    for _ in range(8):
        verify(budget, "a", DRAFTS, 0)
    assert budget.choose({"a": [7, 8]}, 1) == {"a": []}  # 7 is its shadow
    rate = budget.acceptance["a"].rate
    budget.observe_outputs({}, [EngineCoreOutput("a", [7])])
    assert budget.acceptance["a"].rate > rate
    for _ in range(10):  # shadows while it gets no drafts
        if budget.choose({"a": [7, 8]}, 1)["a"]:
            break
        budget.observe_outputs({}, [EngineCoreOutput("a", [7])])
    assert budget.choose({"a": [7, 8]}, 1)["a"][:1] == [7]


def test_a_shadow_that_does_not_come_true_lowers_the_rate_and_is_checked_once():
    budget = measured(linear)
    for _ in range(8):
        verify(budget, "a", DRAFTS, 0)
    budget.choose({"a": [7]}, 1)
    rate = budget.acceptance["a"].rate
    budget.observe_outputs({}, [EngineCoreOutput("a", [3])])
    assert budget.acceptance["a"].rate < rate
    after = budget.acceptance["a"].rate
    budget.observe_outputs({}, [EngineCoreOutput("a", [7])])  # no shadow left to check
    assert budget.acceptance["a"].rate == after


def test_ended_requests_are_forgotten():
    budget = measured(linear)
    verify(budget, "a", DRAFTS, 4)
    budget.forget(["a"])
    assert "a" not in budget.acceptance


def test_a_request_that_finished_is_not_counted():
    budget = measured(linear)
    output = EngineCoreOutput("a", [11, 12, 99], finish_reason="stop")
    budget.observe_outputs({"a": DRAFTS}, [output])
    assert "a" not in budget.acceptance  # (ended: forgotten, and not counted again)
