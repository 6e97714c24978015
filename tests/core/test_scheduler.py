"""The FCFS policy on the core scheduler, driven by a fake model (``conftest.make_engine``).

Every step of every test also checks, in the driver, that the step's token budget and
``max_num_seqs`` hold, that the scheduler's diffs rebuild the same per-request state on the
worker side, and that every KV block is either free or held with a matching ref count.
"""

from __future__ import annotations

import random

import pytest

from vlite.core.outputs import ModelRunnerOutput
from vlite.core.request import RequestStatus
from vlite.core.scheduling_policy import SchedulingPolicy

ABORTED = RequestStatus.FINISHED_ABORTED


def scheduled(result) -> dict[str, int]:
    return dict(result.scheduler_output.num_scheduled_tokens)


def new_ids(result) -> list[str]:
    return [new.request_id for new in result.scheduler_output.new_requests]


def test_empty_scheduler_schedules_nothing(make_engine):
    engine = make_engine()

    result = engine.step()

    assert result.scheduler_output.is_empty
    assert result.outputs == {}
    assert not engine.scheduler.has_unfinished_requests()


def test_request_arriving_mid_flight_joins_the_very_next_step(make_engine):
    engine = make_engine()
    engine.add("a", [1, 2, 3, 4, 5, 6], max_tokens=10)
    assert [scheduled(engine.step()) for _ in range(3)] == [{"a": 6}, {"a": 1}, {"a": 1}]

    engine.add("b", [7, 8, 9, 10, 11])
    result = engine.step()

    assert scheduled(result) == {"a": 1, "b": 5}
    assert new_ids(result) == ["b"]
    assert [c.request_id for c in result.scheduler_output.cached_requests] == ["a"]
    assert result.outputs["b"].new_token_ids == [1000]
    assert engine.scheduler.requests["b"].status is RequestStatus.RUNNING


def test_token_budget_and_max_num_seqs_hold_every_step(make_engine):
    rng = random.Random(0)
    engine = make_engine(num_blocks=40, max_num_seqs=3, max_num_batched_tokens=24)
    expected_num_outputs = {}
    for i in range(20):
        request_id = f"r{i}"
        max_tokens = rng.randrange(1, 12)
        engine.add(
            request_id,
            [rng.randrange(500) for _ in range(rng.randrange(1, 20))],
            max_tokens=max_tokens,
        )
        expected_num_outputs[request_id] = max_tokens
        if i % 3 == 0:
            engine.step()  # more arrive while the batch runs

    engine.run()  # the engine asserts the limits after every schedule()

    steps = engine.steps
    assert max(len(scheduled(s)) for s in steps) == 3  # the limits were actually reached
    assert max(s.scheduler_output.total_num_scheduled_tokens for s in steps) > 18
    num_outputs = {}
    for step in steps:
        for request_id, output in step.outputs.items():
            num_outputs[request_id] = num_outputs.get(request_id, 0) + len(output.new_token_ids)
    assert num_outputs == expected_num_outputs
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks


def test_waiting_request_that_does_not_fit_the_budget_waits_in_arrival_order(make_engine):
    engine = make_engine(max_num_batched_tokens=10)
    engine.add("a", [1, 2, 3, 4, 5, 6])
    engine.add("b", [7, 8, 9, 10, 11, 12])
    engine.add("c", [13, 14])  # would fit, but FCFS admits no one ahead of b

    first = engine.step()
    second = engine.step()

    assert scheduled(first) == {"a": 6}
    assert scheduled(second) == {"a": 1, "b": 6, "c": 2}


def test_max_num_seqs_holds_back_requests_with_budget_to_spare(make_engine):
    engine = make_engine(max_num_seqs=2, max_num_batched_tokens=100)
    for name in "abc":
        engine.add(name, [1, 2, 3], max_tokens=4)

    result = engine.step()

    assert scheduled(result) == {"a": 3, "b": 3}
    assert [r.request_id for r in engine.scheduler.waiting] == ["c"]
    assert engine.scheduler.requests["c"].status is RequestStatus.WAITING


def test_finished_request_leaves_the_batch_and_a_waiting_one_takes_its_place(make_engine):
    engine = make_engine(max_num_seqs=2)
    engine.add("a", [1, 2, 3], max_tokens=2)
    engine.add("b", [4, 5, 6], max_tokens=5)
    engine.add("c", [7, 8, 9, 10], max_tokens=3)

    step1, step2, step3 = engine.step(), engine.step(), engine.step()

    assert scheduled(step1) == {"a": 3, "b": 3}
    assert scheduled(step2) == {"a": 1, "b": 1}
    assert step2.outputs["a"].finish_reason == "length"
    assert step2.outputs["b"].finish_reason is None
    assert "a" not in engine.scheduler.requests
    assert scheduled(step3) == {"b": 1, "c": 4}
    assert new_ids(step3) == ["c"]
    assert step3.scheduler_output.finished_request_ids == ["a"]


def _run_until_preemption(engine):
    for _ in range(20):
        result = engine.step()
        if result.scheduler_output.num_preempted:
            return result
    raise AssertionError("no preemption happened")


def test_preemption_sends_the_latest_admitted_request_back_to_waiting(make_engine):
    # 6 blocks of 4 slots; each request needs 2 blocks at first and 4 by the end.
    engine = make_engine(num_blocks=6, block_size=4)
    a = engine.add("a", list(range(7)), max_tokens=8)
    b = engine.add("b", list(range(100, 107)), max_tokens=8)

    result = _run_until_preemption(engine)

    # Step 7: a grows into its 4th block while both hold 3 and the cache is full.
    assert len(engine.steps) == 7
    assert result.scheduler_output.num_preempted == 1
    assert scheduled(result) == {"a": 1}
    assert b.status is RequestStatus.PREEMPTED
    assert b.num_computed_tokens == 0
    assert b.num_output_tokens == 6  # generated tokens are kept for the recompute
    assert engine.kv_cache.block_ids_of("b") == []
    assert engine.kv_cache.block_ids_of("b") == []
    assert engine.scheduler.waiting == [b]
    assert engine.scheduler.running == [a]
    assert b.num_preemptions == 1
    assert engine.kv_cache.num_free_blocks == 2  # b's 3 blocks came back, a took 1


def test_preempted_request_resumes_and_finishes_with_all_its_tokens(make_engine):
    engine = make_engine(num_blocks=6, block_size=4)
    a = engine.add("a", list(range(7)), max_tokens=8)
    b = engine.add("b", list(range(100, 107)), max_tokens=8)
    _run_until_preemption(engine)

    engine.run()

    resumed = [
        (i + 1, cached)
        for i, step in enumerate(engine.steps)
        for cached in step.scheduler_output.cached_requests
        if cached.is_resumed
    ]
    assert len(resumed) == 1
    step_index, cached = resumed[0]
    assert cached.request_id == "b"
    # Step 8 still lacks room; a finishes in it, and b comes back in step 9, reviving the
    # 2 of its cached blocks that were not evicted (8 tokens) and recomputing the rest.
    assert step_index == 9
    assert cached.num_computed_tokens == 8
    assert scheduled(engine.steps[8]) == {"b": 13 - 8}
    assert a.output_token_ids == list(range(1000, 1008))
    assert b.output_token_ids == list(range(1000, 1008))
    assert a.status is b.status is RequestStatus.FINISHED_LENGTH_CAPPED
    assert engine.scheduler.num_preemptions == 1
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks


def test_preempted_request_recomputes_everything_without_prefix_caching(make_engine):
    engine = make_engine(num_blocks=6, block_size=4, enable_prefix_caching=False)
    engine.add("a", list(range(7)), max_tokens=8)
    b = engine.add("b", list(range(100, 107)), max_tokens=8)
    _run_until_preemption(engine)

    engine.run()

    resumed = [
        (step, cached)
        for step in engine.steps
        for cached in step.scheduler_output.cached_requests
        if cached.is_resumed
    ]
    assert len(resumed) == 1
    step, cached = resumed[0]
    assert cached.num_computed_tokens == 0
    assert scheduled(step)["b"] == 13
    assert b.output_token_ids == list(range(1000, 1008))
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks


def test_many_requests_under_memory_pressure_all_finish_without_leaks(make_engine):
    rng = random.Random(7)
    engine = make_engine(num_blocks=12, block_size=4, max_num_seqs=6, max_num_batched_tokens=32)
    expected = {}
    for i in range(10):
        max_tokens = rng.randrange(4, 14)
        prompt = [rng.randrange(1, 300) for _ in range(rng.randrange(2, 16))]
        engine.add(f"r{i}", prompt, max_tokens=max_tokens)
        expected[f"r{i}"] = list(range(1000, 1000 + max_tokens))

    engine.run(max_steps=500)

    assert engine.scheduler.num_preemptions > 0
    assert_all_finished_without_leaks(engine, expected)


# ---- abort -------------------------------------------------------------------------------


def test_abort_of_a_waiting_request(make_engine):
    engine = make_engine(max_num_seqs=1)
    engine.add("a", [1, 2, 3])
    b = engine.add("b", [4, 5, 6])
    engine.step()
    assert b.status is RequestStatus.WAITING
    num_free = engine.kv_cache.num_free_blocks

    engine.scheduler.finish_requests(["b"], ABORTED)

    assert b.status is ABORTED
    assert b not in engine.scheduler.waiting
    assert "b" not in engine.scheduler.requests
    assert engine.kv_cache.num_free_blocks == num_free
    assert engine.step().scheduler_output.finished_request_ids == ["b"]
    engine.scheduler.finish_requests(["b"], ABORTED)  # idempotent
    assert engine.step().scheduler_output.finished_request_ids == []


def test_abort_of_a_running_request_frees_its_blocks_and_admits_the_next(make_engine):
    engine = make_engine(max_num_seqs=1, enable_prefix_caching=False)
    a = engine.add("a", list(range(10)), max_tokens=20)
    engine.add("b", [50, 51])
    engine.step()
    engine.step()
    assert len(engine.kv_cache.block_ids_of("a")) == 3

    engine.scheduler.finish_requests(["a", "unknown-id"], ABORTED)
    engine.scheduler.finish_requests(["a"], ABORTED)

    assert a.status is ABORTED
    assert engine.kv_cache.block_ids_of("a") == []
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks
    assert engine.scheduler.running == []
    result = engine.step()
    assert result.scheduler_output.finished_request_ids == ["a"]
    assert scheduled(result) == {"b": 2}
    assert engine.steps[-1].outputs.keys() == {"b"}


def test_abort_between_schedule_and_update_drops_the_sampled_token(make_engine):
    engine = make_engine()
    a = engine.add("a", [1, 2, 3])
    engine.step()

    so = engine.scheduler.schedule()
    assert so.num_scheduled_tokens == {"a": 1}
    engine.scheduler.finish_requests(["a"], ABORTED)
    out = engine.scheduler.update_from_output(so, ModelRunnerOutput({"a": [1001]}))

    assert out.outputs == []
    assert a.output_token_ids == [1000]
    assert a.status is ABORTED
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks
    assert engine.scheduler.schedule().finished_request_ids == ["a"]


def test_abort_of_a_preempted_request(make_engine):
    engine = make_engine(num_blocks=6, block_size=4)
    engine.add("a", list(range(7)), max_tokens=8)
    b = engine.add("b", list(range(100, 107)), max_tokens=8)
    _run_until_preemption(engine)

    engine.scheduler.finish_requests(["b"], ABORTED)

    assert b.status is ABORTED
    assert engine.scheduler.waiting == []
    assert engine.step().scheduler_output.finished_request_ids == ["b"]
    engine.run()
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks


# ---- prefix caching ----------------------------------------------------------------------


def test_prefix_cache_hit_reduces_the_scheduled_tokens_of_a_second_request(make_engine):
    engine = make_engine(block_size=4)
    prompt_a = list(range(20))
    engine.add("a", prompt_a)
    engine.step()
    a_blocks = engine.kv_cache.block_ids_of("a")

    b = engine.add("b", prompt_a[:16] + [90, 91, 92, 93])
    result = engine.step()

    assert scheduled(result) == {"a": 1, "b": 4}
    (new,) = result.scheduler_output.new_requests
    assert new.num_computed_tokens == 16
    assert new.block_ids[:4] == a_blocks[:4]
    assert b.num_cached_tokens == 16
    assert result.outputs["b"].num_cached_tokens == 16
    assert [engine.kv_cache.blocks[i].ref_count for i in a_blocks[:5]] == [2, 2, 2, 2, 1]
    # Each admission is counted once: a's 20 tokens (no hit), then b's 20 (16 hit).
    assert engine.kv_cache.num_prefix_queried_tokens == 40
    assert engine.kv_cache.num_prefix_hit_tokens == 16


def test_without_prefix_caching_the_second_request_computes_its_whole_prompt(make_engine):
    engine = make_engine(block_size=4, enable_prefix_caching=False)
    prompt_a = list(range(20))
    engine.add("a", prompt_a)
    engine.step()

    b = engine.add("b", prompt_a[:16] + [90, 91, 92, 93])
    result = engine.step()

    assert scheduled(result) == {"a": 1, "b": 20}
    assert b.num_cached_tokens == 0


# ---- the shared mechanism under another policy -------------------------------------------


class EarliestVictimPolicy(SchedulingPolicy):
    """A test-only policy: chunks prompts (at most 8 tokens a step), and the victim is the
    *earliest*-admitted running request, which may already be scheduled in this step (as
    with a priority policy); ``vlite.core.scheduler._StepPlan.unschedule`` exists for it."""

    default_enable_chunked_prefill = True

    def waiting_sort_key(self, request):
        return (request.arrival_index,)

    def choose_victim(self, running):
        return running[0]

    def max_chunk_tokens(self, request):
        return 8


def test_preempting_a_request_scheduled_earlier_in_the_step_caches_none_of_its_new_blocks(
    make_engine,
):
    # 5 blocks of 4 slots, budget 12.
    # Step 1: a computes prompt tokens 0-7 (blocks a0 a1); c computes tokens 0-3 (c0).
    # Step 2: both are prefilling, in admission order: a is scheduled for tokens 8-15
    #         (takes a2 a3: cache full); c then needs a block for tokens 4-7, so the policy
    #         preempts a, which is unscheduled: tokens 8-15 are never computed.
    # Later a is re-admitted. Only tokens 0-7 ever had their K/V written, so at most 8
    # tokens may come from the prefix cache: block a2 must not be offered as a cached
    # block for tokens 8-11.
    engine = make_engine(
        num_blocks=5,
        block_size=4,
        max_num_batched_tokens=12,
        scheduler_cls=EarliestVictimPolicy,
    )
    a = engine.add("a", list(range(16)), max_tokens=2)
    engine.add("c", list(range(100, 112)), max_tokens=3)

    step1, step2 = engine.step(), engine.step()
    assert scheduled(step1) == {"a": 8, "c": 4}
    assert step2.scheduler_output.num_preempted == 1
    assert scheduled(step2) == {"c": 4}
    assert a.status is RequestStatus.PREEMPTED
    engine.run()

    resumed = [
        cached
        for step in engine.steps
        for cached in step.scheduler_output.cached_requests
        if cached.is_resumed
    ]
    assert [cached.request_id for cached in resumed] == ["a"]
    assert resumed[0].num_computed_tokens <= 8


@pytest.mark.parametrize("chunked", [False, True])
def test_a_sliding_window_releases_blocks_under_pressure_without_leaks(make_engine, chunked):
    """Shared prefixes, preemption and (maybe) chunking with blocks leaving a 6-token window:
    every request finishes with all its tokens, the worker's tables always match the cache's
    and every block's count matches its holders (checked by the driver each step)."""
    rng = random.Random(11)
    engine = make_engine(
        num_blocks=8 if chunked else 14,
        block_size=4,
        max_num_seqs=5,
        max_num_batched_tokens=12 if chunked else 32,
        enable_chunked_prefill=chunked,
        sliding_window=6,
    )
    shared = [rng.randrange(1, 300) for _ in range(9)]
    expected = {}
    for i in range(12):
        max_tokens = rng.randrange(4, 30)
        prompt = shared[: rng.randrange(0, 10)] + [rng.randrange(1, 300) for _ in range(5)]
        engine.add(f"r{i}", prompt, max_tokens=max_tokens)
        expected[f"r{i}"] = list(range(1000, 1000 + max_tokens))

    engine.run(max_steps=800)

    assert engine.scheduler.num_preemptions > 0
    assert engine.kv_cache.num_prefix_hit_tokens > 0
    assert_all_finished_without_leaks(engine, expected)


def assert_all_finished_without_leaks(engine, expected: dict[str, list[int]]) -> None:
    """Every request produced exactly ``expected[request_id]``; every block is free again."""
    outputs: dict[str, list[int]] = {}
    for step in engine.steps:
        for request_id, output in step.outputs.items():
            outputs.setdefault(request_id, []).extend(output.new_token_ids)
    assert outputs == expected
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks
    assert all(block.ref_count == 0 for block in engine.kv_cache.blocks)
