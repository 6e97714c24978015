"""StepStats from the shared mechanism, and the TraceWriter's JSONL."""

from __future__ import annotations

import io
import json

from vlite.core.outputs import EngineCoreOutputs
from vlite.core.request import RequestStatus
from vlite.core.stats import BatchEntry, StepRecord, StepTotals, TraceWriter
from vlite.plugins.schedulers.fcfs import FcfsPolicy
from vlite.testing.scheduler_driver import SchedulerDriver


def make_driver(**settings) -> SchedulerDriver:
    options = dict(num_blocks=32, block_size=4, max_num_seqs=4, max_num_batched_tokens=16)
    options.update(settings)
    return SchedulerDriver.create(FcfsPolicy, **options)


def test_stats_describe_the_batch_blocks_and_prefix_hits():
    driver = make_driver()
    shared = list(range(1, 9))  # two full blocks
    driver.add("first", [*shared, 50], 3)
    driver.step()
    stats = driver.scheduler.last_step_stats
    assert (stats.step_index, stats.num_prefill_requests, stats.num_prefill_tokens) == (0, 1, 9)
    assert (stats.num_decode_requests, stats.num_scheduled_tokens) == (0, 9)
    assert (stats.num_kv_blocks_used, stats.num_kv_blocks_free) == (3, 29)
    assert stats.num_prefix_cache_queried_tokens == 9 and stats.num_prefix_cache_hit_tokens == 0

    driver.add("second", [*shared, 60, 61], 3)
    driver.step()
    stats = driver.scheduler.last_step_stats
    assert stats.step_index == 1 and stats.num_scheduled_requests == 2
    assert (stats.num_decode_requests, stats.num_decode_tokens) == (1, 1)
    assert (stats.num_prefill_requests, stats.num_prefill_tokens) == (1, 2)  # 8 cached
    assert stats.num_prefix_cache_hit_tokens == 8 and stats.num_prefix_cache_queried_tokens == 10
    assert stats.num_kv_blocks_used == 4  # "second" shares two blocks with "first"
    assert stats.num_running_requests == 2 and stats.num_waiting_requests == 0
    assert stats.num_preemptions == stats.num_waits_budget == 0


def test_waits_for_max_num_seqs_and_for_the_budget_are_counted():
    driver = make_driver(max_num_seqs=1)
    driver.add("a", [1, 2, 3], 2)
    driver.add("b", [4, 5, 6], 2)
    driver.step()
    stats = driver.scheduler.last_step_stats
    assert stats.num_waits_max_num_seqs == 1 and stats.num_waits_budget == 0

    driver = make_driver(max_num_batched_tokens=8)
    driver.add("a", [1, 2, 3, 4, 5, 6], 2)
    driver.add("b", [7, 8, 9, 10, 11, 12], 2)
    driver.step()
    stats = driver.scheduler.last_step_stats
    assert stats.num_waits_budget == 1 and stats.num_waits_max_num_seqs == 0
    assert stats.num_waits_no_blocks == 0


def test_waits_for_blocks_and_preemptions_are_counted():
    driver = make_driver(num_blocks=4, max_num_batched_tokens=32)
    driver.add("a", list(range(1, 14)), 3)  # all four blocks once decoding
    driver.step()
    driver.add("b", [20, 21, 22], 2)
    driver.step()
    stats = driver.scheduler.last_step_stats
    assert stats.num_waits_no_blocks == 1 and stats.num_kv_blocks_free == 0
    driver.run()

    driver = make_driver(num_blocks=4, max_num_batched_tokens=32)
    driver.add("a", [1, 2, 3, 4, 5, 6, 7], 8)
    driver.add("b", [11, 12, 13, 14, 15, 16, 17], 8)
    preemptions = []
    while driver.scheduler.has_unfinished_requests():
        driver.step()
        preemptions.append(driver.scheduler.last_step_stats.num_preemptions)
    assert sum(preemptions) == driver.scheduler.num_preemptions > 0


def test_trace_writer_writes_a_step_line_then_one_line_per_request():
    driver = make_driver()
    driver.add("a", [1, 2, 3], 4)
    driver.add("b", [4, 5], 1)
    so = driver.scheduler.schedule()
    batch = [
        BatchEntry(rid, n, driver.scheduler.requests[rid].num_computed_tokens, True)
        for rid, n in so.num_scheduled_tokens.items()
    ]
    requests = list(driver.scheduler.requests.values())
    requests[1].status = RequestStatus.FINISHED_LENGTH_CAPPED
    buffer = io.StringIO()

    TraceWriter(buffer)(StepRecord(driver.scheduler.last_step_stats, batch, requests))

    lines = [json.loads(line) for line in buffer.getvalue().splitlines()]
    assert [line["event"] for line in lines] == ["step", "request", "request"]
    assert lines[0]["num_scheduled_tokens"] == 5 and lines[0]["step_index"] == 0
    assert lines[0]["batch"] == [
        {
            "request_id": "a",
            "num_scheduled_tokens": 3,
            "num_computed_tokens": 0,
            "phase": "prefill",
        },
        {
            "request_id": "b",
            "num_scheduled_tokens": 2,
            "num_computed_tokens": 0,
            "phase": "prefill",
        },
    ]
    assert lines[2]["request_id"] == "b" and lines[2]["status"] == "finished_length_capped"
    assert {"num_computed_tokens", "num_tokens"} <= set(lines[1])


def test_step_totals_sum_every_step():
    driver = make_driver(num_blocks=5, max_num_batched_tokens=64)
    totals = StepTotals()
    shared = list(range(1, 9))
    driver.add("a", [*shared, 50], 6)
    driver.add("b", [*shared, 60], 6)
    driver.add("c", list(range(20, 33)), 4)
    steps = []
    while driver.scheduler.has_unfinished_requests():
        step = driver.step()
        steps.append(driver.scheduler.last_step_stats)
        totals.add(steps[-1], EngineCoreOutputs(list(step.outputs.values())))

    assert totals.num_steps == len(steps)
    for name in (
        "num_prefill_tokens",
        "num_prefix_cache_queried_tokens",
        "num_prefix_cache_hit_tokens",
        "num_preemptions",
    ):
        assert getattr(totals, name) == sum(getattr(s, name) for s in steps), name
    assert totals.num_prefix_cache_hit_tokens >= 8  # "b" reused "a"'s two full blocks
    assert totals.num_preemptions > 0  # five blocks cannot hold all three
    # Generated tokens are the sampled ones; prompt tokens count each request once, although
    # preempted requests recomputed theirs (so more prefill tokens were computed).
    assert totals.num_generation_tokens == 6 + 6 + 4
    assert totals.num_new_prompt_tokens == 9 + 9 + 13
    recomputed_or_cached = totals.num_prefill_tokens + totals.num_prefix_cache_hit_tokens
    assert recomputed_or_cached > totals.num_new_prompt_tokens
    assert driver.outputs == driver.expected
