"""The priority policy on the core scheduler, driven by SchedulerDriver (every step checked)."""

from __future__ import annotations

from vlite.core.request import RequestStatus
from vlite.plugins.schedulers.fcfs import FcfsPolicy
from vlite.plugins.schedulers.priority import PriorityPolicy
from vlite.testing.scheduler_driver import SchedulerDriver


def make_driver(scheduler_cls=PriorityPolicy, **settings) -> SchedulerDriver:
    options = dict(num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=64)
    options.update(settings)
    return SchedulerDriver.create(scheduler_cls, **options)


def run_recording_finish_order(driver: SchedulerDriver) -> list[str]:
    order: list[str] = []
    while driver.scheduler.has_unfinished_requests():
        driver.step()
        order += [rid for rid in driver.finish_reasons if rid not in order]
    return order


def test_with_max_num_seqs_1_requests_finish_in_priority_order_ties_by_arrival():
    driver = make_driver(max_num_seqs=1)
    priorities = {"a": 2, "b": 0, "c": 1, "d": 0, "e": -1, "f": 2}
    for index, (request_id, priority) in enumerate(priorities.items()):
        driver.add(
            request_id, [10 * index + 1, 10 * index + 2, 10 * index + 3], 3, priority=priority
        )

    order = run_recording_finish_order(driver)

    assert order == ["e", "b", "d", "c", "a", "f"]
    assert all(driver.outputs[r] == driver.expected[r] for r in priorities)
    driver.check_all_finished_cleanly()


def test_an_urgent_arrival_is_admitted_before_earlier_waiting_requests():
    driver = make_driver(max_num_seqs=1)
    driver.add("first", [1, 2, 3], 4, priority=5)
    driver.step()  # "first" runs alone
    driver.add("later-low", [4, 5, 6], 2, priority=5)
    driver.add("urgent", [7, 8, 9], 2, priority=0)

    order = run_recording_finish_order(driver)

    # max_num_seqs is no reason to preempt: "first" finishes, then the urgent one.
    assert order == ["first", "urgent", "later-low"]
    assert driver.scheduler.num_preemptions == 0


def start_low_then_high(scheduler_cls) -> tuple[SchedulerDriver, object, object]:
    """Four blocks of 4: "low" (priority 5) is admitted a step before "high" (priority 0).

    The third step needs a fifth block for "low"'s decode: someone must be preempted.
    """
    driver = make_driver(scheduler_cls, num_blocks=4)
    low = driver.add("low", [1, 2, 3, 4, 5, 6, 7], 8, priority=5)
    driver.step()
    high = driver.add("high", [11, 12, 13, 14, 15, 16, 17], 8, priority=0)
    driver.step()
    assert [r.request_id for r in driver.scheduler.running] == ["low", "high"]
    assert driver.kv_cache.num_free_blocks == 0
    return driver, low, high


def test_under_block_pressure_the_least_urgent_running_request_is_preempted():
    driver, low, high = start_low_then_high(PriorityPolicy)

    so = driver.step().scheduler_output

    assert so.num_preempted == 1
    assert low.status is RequestStatus.PREEMPTED and high.status is RequestStatus.RUNNING
    assert list(so.num_scheduled_tokens) == ["high"]
    driver.run()
    assert low.num_preemptions >= 1 and high.num_preemptions == 0
    assert driver.outputs == driver.expected
    driver.check_all_finished_cleanly()


def test_fcfs_in_the_same_situation_preempts_the_latest_admitted_instead():
    # The contrast that makes the test above meaningful: arrival order alone picks "high".
    driver, low, high = start_low_then_high(FcfsPolicy)

    driver.step()

    assert high.status is RequestStatus.PREEMPTED and low.status is RequestStatus.RUNNING


def fill_cache_with(scheduler_cls, priority_of_arrival: int):
    """ "low" (priority 5) holds all four blocks; then "arrival" comes, needing two."""
    driver = make_driver(scheduler_cls, num_blocks=4)
    low = driver.add("low", list(range(1, 14)), 3, priority=5)
    driver.step()
    assert driver.kv_cache.num_free_blocks == 0
    arrival = driver.add("arrival", [21, 22, 23, 24, 25], 3, priority=priority_of_arrival)
    return driver, low, arrival


def test_an_urgent_arrival_preempts_a_less_urgent_running_request_when_no_blocks_are_free():
    driver, low, arrival = fill_cache_with(PriorityPolicy, priority_of_arrival=0)

    so = driver.step().scheduler_output

    assert dict(so.num_scheduled_tokens) == {"arrival": 5}
    assert [new.request_id for new in so.new_requests] == ["arrival"]
    assert so.num_preempted == 1 and low.status is RequestStatus.PREEMPTED
    stats = driver.scheduler.last_step_stats
    assert stats.num_preemptions == 1 and stats.num_waits_no_blocks == 0
    driver.run()
    assert driver.outputs == driver.expected
    driver.check_all_finished_cleanly()


def test_an_arrival_of_equal_priority_waits_for_blocks_instead_of_preempting():
    driver, low, arrival = fill_cache_with(PriorityPolicy, priority_of_arrival=5)

    so = driver.step().scheduler_output

    assert dict(so.num_scheduled_tokens) == {"low": 1}
    assert so.num_preempted == 0 and arrival.status is RequestStatus.WAITING
    assert driver.scheduler.last_step_stats.num_waits_no_blocks == 1
    driver.run()
    assert driver.outputs == driver.expected


def test_fcfs_never_preempts_for_an_arrival():
    driver, low, arrival = fill_cache_with(FcfsPolicy, priority_of_arrival=0)

    so = driver.step().scheduler_output

    assert so.num_preempted == 0 and dict(so.num_scheduled_tokens) == {"low": 1}
    assert driver.scheduler.last_step_stats.num_waits_no_blocks == 1


def test_many_prioritised_requests_under_memory_pressure_finish_with_their_own_tokens():
    driver = make_driver(num_blocks=12, max_num_seqs=6, max_num_batched_tokens=32)
    request_ids = []
    for index in range(16):
        prompt = [(7 * index + offset) % 800 + 1 for offset in range(3 + index % 9)]
        request_ids.append(f"r{index}")
        driver.add(request_ids[-1], prompt, 4 + index % 7, priority=index % 3)
    driver.run()
    assert driver.outputs == driver.expected
    assert driver.scheduler.num_preemptions > 0
    driver.check_all_finished_cleanly()


def vip_and_low_fill_the_cache(arrival_prompt_len: int):
    """Eight blocks of 4: "vip" (priority 0) holds five, "low" (priority 5) three.

    Then "arrival" (priority 1) comes: only "low" is less urgent than it.
    """
    driver = make_driver(num_blocks=8)
    driver.add("vip", list(range(1, 18)), 3, priority=0)
    low = driver.add("low", list(range(31, 40)), 3, priority=5)
    driver.step()
    assert driver.kv_cache.num_free_blocks == 0
    arrival = driver.add("arrival", list(range(51, 51 + arrival_prompt_len)), 3, priority=1)
    return driver, low, arrival


def test_an_urgent_arrival_preempts_nobody_when_that_would_not_free_enough_blocks():
    # "arrival" needs four blocks; preempting "low" frees only three, so "low" keeps
    # running instead of being recomputed for nothing.
    driver, low, arrival = vip_and_low_fill_the_cache(arrival_prompt_len=13)

    so = driver.step().scheduler_output

    assert so.num_preempted == 0 and low.status is RequestStatus.RUNNING
    assert arrival.status is RequestStatus.WAITING
    assert set(so.num_scheduled_tokens) == {"vip", "low"}
    assert driver.scheduler.last_step_stats.num_waits_no_blocks == 1
    driver.run()
    assert driver.outputs == driver.expected
    assert low.num_preemptions == 0
    driver.check_all_finished_cleanly()


def test_an_urgent_arrival_preempts_when_the_freed_blocks_suffice():
    # The contrast: a three-block arrival fits in what "low" frees.
    driver, low, arrival = vip_and_low_fill_the_cache(arrival_prompt_len=12)

    so = driver.step().scheduler_output

    assert so.num_preempted == 1 and low.status is RequestStatus.PREEMPTED
    assert arrival.status is RequestStatus.RUNNING
    driver.run()
    assert driver.outputs == driver.expected
    driver.check_all_finished_cleanly()
