"""The scheduler's side of speculative decoding: a request's drafts are scheduled after its
last token within the budget, the rejected ones are rolled back, and blocks that held only
rejected drafts go back (the worker hears of it with the request's next step)."""

from __future__ import annotations

import pytest

from vlite.core.outputs import ModelRunnerOutput
from vlite.core.request import EngineCoreRequest, Request
from vlite.core.sampling_params import SamplingParams
from vlite.plugins.schedulers.fcfs import FcfsPolicy
from vlite.testing.scheduler_driver import SchedulerDriver


def running_request(block_size=4, budget=64, prompt=(1, 2, 3)):
    """A scheduler holding request ``a`` after its prompt step (one token sampled: 7)."""
    driver = SchedulerDriver.create(
        FcfsPolicy, block_size=block_size, max_num_batched_tokens=budget, num_blocks=32
    )
    scheduler = driver.scheduler
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    scheduler.add_request(Request(EngineCoreRequest("a", list(prompt), params)))
    first = scheduler.schedule()
    scheduler.update_from_output(first, ModelRunnerOutput({"a": [7]}))
    return scheduler, driver.kv_cache


def test_drafts_are_scheduled_after_the_last_token_and_sent_to_the_worker():
    scheduler, _ = running_request()
    scheduler.requests["a"].spec_token_ids = [8, 9, 10]
    output = scheduler.schedule()
    assert output.num_scheduled_tokens == {"a": 4}
    assert output.spec_token_ids == {"a": [8, 9, 10]}
    assert scheduler.requests["a"].spec_token_ids == []  # consumed


def test_drafts_beyond_the_budget_are_dropped():
    scheduler, _ = running_request(budget=3)
    scheduler.requests["a"].spec_token_ids = [8, 9, 10, 11]
    output = scheduler.schedule()
    assert output.num_scheduled_tokens == {"a": 3}
    assert output.spec_token_ids == {"a": [8, 9]}


@pytest.mark.parametrize(("tokens", "computed"), [([8, 9, 10, 11], 7), ([8, 5], 5), ([6], 4)])
def test_rejected_drafts_are_rolled_back(tokens, computed):
    scheduler, _ = running_request()
    request = scheduler.requests["a"]
    request.spec_token_ids = [8, 9, 10]
    output = scheduler.schedule()
    scheduler.update_from_output(output, ModelRunnerOutput({"a": tokens}))
    # Prompt (3) + 7 computed before; then the kept drafts, not the last token.
    assert request.all_token_ids == [1, 2, 3, 7, *tokens]
    assert request.num_computed_tokens == computed
    assert scheduler.num_draft_tokens == 3 and scheduler.num_accepted_tokens == len(tokens) - 1


def test_blocks_of_rejected_drafts_go_back_and_the_worker_is_told():
    scheduler, kv = running_request(block_size=4)
    request = scheduler.requests["a"]
    request.spec_token_ids = [8, 9, 10, 11, 12, 13]  # positions 4..9: blocks 1 and 2
    output = scheduler.schedule()
    assert len(kv.block_ids_of("a")) == 3
    free_before = kv.num_free_blocks
    scheduler.update_from_output(output, ModelRunnerOutput({"a": [5]}))  # none kept
    assert len(kv.block_ids_of("a")) == 2  # 5 known tokens fill two blocks of 4
    assert kv.num_free_blocks == free_before + 1
    (cached,) = scheduler.schedule().cached_requests
    assert cached.num_kept_blocks == 2


def test_a_worker_answer_that_does_not_start_with_the_kept_drafts_is_a_bug():
    scheduler, _ = running_request()
    scheduler.requests["a"].spec_token_ids = [8, 9]
    output = scheduler.schedule()
    with pytest.raises(RuntimeError, match="expected the accepted drafts"):
        scheduler.update_from_output(output, ModelRunnerOutput({"a": [9, 9, 9]}))
