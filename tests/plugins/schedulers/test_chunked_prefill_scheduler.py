"""ChunkedPrefillScheduler driven by the fake-model SchedulerDriver (every step checked)."""

from __future__ import annotations

from vlite.core.kv_cache import KVCacheManager
from vlite.core.request import Request
from vlite.core.scheduler import SchedulerLimits
from vlite.plugins.schedulers.chunked_prefill import ChunkedPrefillScheduler
from vlite.plugins.schedulers.fcfs import FcfsScheduler
from vlite.testing.scheduler_driver import SchedulerDriver


def make_driver(**settings) -> SchedulerDriver:
    options = dict(
        num_blocks=128,
        block_size=4,
        max_num_seqs=8,
        max_num_batched_tokens=16,
        allows_chunking=True,
    )
    options.update(settings)
    return SchedulerDriver.create(ChunkedPrefillScheduler, **options)


def test_a_prompt_longer_than_the_budget_is_computed_in_chunks():
    driver = make_driver()
    driver.add("long", list(range(1, 101)), 3)

    chunks = [driver.step().num_scheduled_tokens["long"] for _ in range(7)]

    assert chunks == [16, 16, 16, 16, 16, 16, 4]  # the 7th completes the prompt
    assert driver.outputs["long"] == driver.expected["long"][:1]
    driver.run()
    assert driver.outputs == driver.expected
    driver.check_all_finished_cleanly()


def test_decodes_keep_running_while_a_long_prompt_is_chunked():
    driver = make_driver()
    driver.add("a", [1, 2, 3], 30)
    driver.add("b", [4, 5, 6, 7], 30)
    driver.step()
    driver.add("long", list(range(100, 200)), 2)

    steps = [driver.step() for _ in range(5)]

    for so in steps:
        scheduled = so.num_scheduled_tokens
        assert list(scheduled)[:2] == ["a", "b"] and scheduled["a"] == scheduled["b"] == 1
        assert scheduled["long"] == 14  # the rest of the budget
        stats = driver.scheduler.last_step_stats
    assert (stats.num_decode_requests, stats.num_decode_tokens) == (2, 2)
    assert (stats.num_prefill_requests, stats.num_prefill_tokens) == (1, 14)
    driver.run()
    assert driver.outputs == driver.expected


def test_fcfs_stalls_the_same_workload_behind_whole_prompts():
    # Contrast: without chunking a 48-token prompt waits until the whole budget is free.
    driver = SchedulerDriver.create(
        FcfsScheduler, num_blocks=128, block_size=4, max_num_seqs=8, max_num_batched_tokens=48
    )
    driver.add("a", [1, 2, 3], 3)
    driver.step()
    driver.add("long", list(range(100, 148)), 2)
    so = driver.step()
    assert dict(so.num_scheduled_tokens) == {"a": 1}
    assert driver.scheduler.last_step_stats.num_waits_budget == 1


def make_request(request_id: str, num_prompt: int, num_computed: int) -> Request:
    driver = make_driver()
    request = driver.add(request_id, list(range(1, num_prompt + 1)), 4)
    request.num_computed_tokens = num_computed
    return request


def test_running_order_puts_decodes_before_prefill_chunks_and_keeps_their_order():
    scheduler = ChunkedPrefillScheduler(SchedulerLimits(8, 16, 256), KVCacheManager(64, 4))
    prefill_1 = make_request("p1", 40, 16)
    decode_1 = make_request("d1", 5, 5)
    prefill_2 = make_request("p2", 30, 0)
    decode_2 = make_request("d2", 7, 7)
    running = [prefill_1, decode_1, prefill_2, decode_2]

    ordered = scheduler.running_order(running)

    assert ordered == [decode_1, decode_2, prefill_1, prefill_2]
    assert running == [prefill_1, decode_1, prefill_2, decode_2], "the input was changed"


def test_the_mechanism_schedules_running_requests_in_running_order():
    class ReversedScheduler(FcfsScheduler):
        def running_order(self, running):
            return running[::-1]

    driver = SchedulerDriver.create(
        ReversedScheduler, num_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=64
    )
    for name in "abc":
        driver.add(name, [ord(name), 1, 2], 4)
    driver.step()
    assert list(driver.step().num_scheduled_tokens) == ["c", "b", "a"]
    driver.run()
    assert driver.outputs == driver.expected


def test_chunked_requests_under_memory_pressure_are_preempted_and_restored():
    driver = make_driver(num_blocks=20, max_num_batched_tokens=12, max_num_seqs=4)
    for index in range(8):
        prompt = [(11 * index + offset) % 700 + 1 for offset in range(10 + 5 * index)]
        driver.add(f"r{index}", prompt, 6)
    driver.run()
    assert driver.scheduler.num_preemptions > 0
    assert driver.num_chunked_steps > 0
    assert driver.outputs == driver.expected
    driver.check_all_finished_cleanly()
