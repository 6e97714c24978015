"""Chunked prefill, the core scheduler's mechanism, driven by SchedulerDriver (every step
checked): with the ``chunked-prefill`` policy (FCFS, chunking on by default) and composed with
other policies."""

from __future__ import annotations

import pytest

from vlite.core.errors import PluginError
from vlite.core.kv_cache import KVCacheManager
from vlite.core.request import Request
from vlite.core.scheduler import (
    MIN_PROMPT_TOKENS_BESIDE_DECODES,
    MIN_STEP_OVER_DECODES,
    SchedulerLimits,
    build_scheduler,
)
from vlite.core.step_cost import StepCostModel
from vlite.plugins.schedulers.chunked_prefill import ChunkedPrefillPolicy
from vlite.plugins.schedulers.fcfs import FcfsPolicy
from vlite.plugins.schedulers.priority import PriorityPolicy
from vlite.testing.scheduler_driver import SchedulerDriver


def make_driver(scheduler_cls=ChunkedPrefillPolicy, **settings) -> SchedulerDriver:
    options = dict(num_blocks=128, block_size=4, max_num_seqs=8, max_num_batched_tokens=16)
    options.update(settings)
    return SchedulerDriver.create(scheduler_cls, **options)


def test_a_prompt_longer_than_the_budget_is_computed_in_chunks():
    driver = make_driver()
    driver.add("long", list(range(1, 101)), 3)

    chunks = [driver.step().scheduler_output.num_scheduled_tokens["long"] for _ in range(7)]

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

    steps = [driver.step().scheduler_output for _ in range(5)]

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
        FcfsPolicy, num_blocks=128, block_size=4, max_num_seqs=8, max_num_batched_tokens=48
    )
    driver.add("a", [1, 2, 3], 3)
    driver.step()
    driver.add("long", list(range(100, 148)), 2)
    so = driver.step().scheduler_output
    assert dict(so.num_scheduled_tokens) == {"a": 1}
    assert driver.scheduler.last_step_stats.num_waits_budget == 1


def make_request(request_id: str, num_prompt: int, num_computed: int) -> Request:
    driver = make_driver()
    request = driver.add(request_id, list(range(1, num_prompt + 1)), 4)
    request.num_computed_tokens = num_computed
    return request


def test_with_chunking_decodes_go_before_prefill_chunks_in_the_policy_order():
    scheduler = build_scheduler(
        ChunkedPrefillPolicy, SchedulerLimits(8, 16, 256, None), KVCacheManager(64, 4)
    )
    prefill_1 = make_request("p1", 40, 16)
    decode_1 = make_request("d1", 5, 5)
    prefill_2 = make_request("p2", 30, 0)
    decode_2 = make_request("d2", 7, 7)
    scheduler.running = [prefill_1, decode_1, prefill_2, decode_2]

    ordered = scheduler._checked_running_order()

    assert ordered == [decode_1, decode_2, prefill_1, prefill_2]
    assert scheduler.running == [prefill_1, decode_1, prefill_2, decode_2], "running changed"


def test_the_mechanism_schedules_running_requests_in_running_order():
    class ReversedPolicy(FcfsPolicy):
        def running_order(self, running):
            return running[::-1]

    driver = SchedulerDriver.create(
        ReversedPolicy, num_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=64
    )
    for name in "abc":
        driver.add(name, [ord(name), 1, 2], 4)
    driver.step()
    assert list(driver.step().scheduler_output.num_scheduled_tokens) == ["c", "b", "a"]
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


# ---- composition: chunking is a setting, the policy is separate ----------------------


def test_chunked_prefill_is_fcfs_with_chunking_on_and_can_be_turned_off():
    assert make_driver(FcfsPolicy).allows_chunking is False
    assert make_driver(FcfsPolicy, enable_chunked_prefill=True).allows_chunking is True
    assert make_driver().allows_chunking is True
    assert make_driver(enable_chunked_prefill=False).allows_chunking is False


def test_priority_with_chunking_admits_the_urgent_request_first_and_never_stalls_decodes():
    # One run shows both axes: "urgent" (priority 0) arrives after "lazy" (priority 5) and
    # is admitted first; both prompts are longer than the budget and are chunked while the
    # running request keeps decoding one token every step.
    driver = make_driver(PriorityPolicy, enable_chunked_prefill=True, max_num_seqs=2)
    driver.add("stream", [1, 2, 3], 40, priority=9)
    driver.step()
    driver.add("lazy", list(range(100, 150)), 2, priority=5)
    driver.add("urgent", list(range(200, 250)), 2, priority=0)

    steps = [driver.step().scheduler_output for _ in range(4)]

    assert [new.request_id for so in steps for new in so.new_requests] == ["urgent"]
    for so in steps:
        assert so.num_scheduled_tokens["stream"] == 1, "the running stream stalled"
    assert [so.num_scheduled_tokens["urgent"] for so in steps] == [15, 15, 15, 5]
    driver.run()
    assert driver.outputs == driver.expected
    driver.check_all_finished_cleanly()


def test_long_prefill_token_threshold_lets_two_prompts_share_a_step():
    driver = make_driver(long_prefill_token_threshold=6)
    driver.add("a", list(range(1, 31)), 2)
    driver.add("b", list(range(40, 70)), 2)

    so = driver.step().scheduler_output

    assert dict(so.num_scheduled_tokens) == {"a": 6, "b": 6}
    driver.run()
    assert driver.outputs == driver.expected


def test_a_policy_may_set_each_request_s_chunk_size():
    class SmallChunksForLowPriority(FcfsPolicy):
        def max_chunk_tokens(self, request):
            return 4 if request.priority > 0 else None

    driver = make_driver(SmallChunksForLowPriority, enable_chunked_prefill=True)
    driver.add("low", list(range(1, 21)), 2, priority=1)
    driver.add("high", list(range(30, 50)), 2, priority=0)

    so = driver.step().scheduler_output

    assert dict(so.num_scheduled_tokens) == {"low": 4, "high": 12}
    driver.run()
    assert driver.outputs == driver.expected


class _BrokenAnswers(FcfsPolicy):
    victim = "not running"
    chunk = None
    drop_one = False

    def choose_victim(self, running):
        return self.victim

    def max_chunk_tokens(self, request):
        return self.chunk

    def running_order(self, running):
        return running[1:] if self.drop_one else list(running)


@pytest.mark.parametrize(
    ("attribute", "value", "settings", "message"),
    [
        ("victim", "not running", {"num_blocks": 3}, "choose_victim returned 'not running'"),
        ("chunk", 0, {"enable_chunked_prefill": True}, "max_chunk_tokens returned 0"),
        ("drop_one", True, {}, "running_order must return the running requests"),
    ],
)
def test_a_policy_s_answers_are_checked_and_errors_name_it(attribute, value, settings, message):
    policy_cls = type("BadPolicy", (_BrokenAnswers,), {attribute: value})
    driver = make_driver(policy_cls, **settings)
    driver.add("a", [1, 2, 3, 4, 5], 6)
    driver.add("b", [6, 7, 8], 6)
    with pytest.raises(PluginError, match=message) as info:
        driver.run()
    assert "BadPolicy" in str(info.value)


def test_a_subclass_written_for_plugin_api_1_still_works_and_is_deprecated():
    from vlite.core.scheduler import Scheduler

    class Api1ShortestFirst(Scheduler):
        supports_chunked_prefill = False

        def waiting_sort_key(self, request):
            return (request.num_prompt_tokens, self.arrival_index(request))

        def choose_victim(self, running):
            return max(running, key=self.waiting_sort_key)

    with pytest.warns(DeprecationWarning, match="plugin API 1"):
        driver = make_driver(Api1ShortestFirst, max_num_seqs=1, max_num_batched_tokens=64)
    for request_id, length in [("long", 30), ("short", 3), ("middle", 12)]:
        driver.add(request_id, list(range(1, length + 1)), 2)
    admitted = [n.request_id for step in driver.run() for n in step.scheduler_output.new_requests]
    assert admitted == ["short", "middle", "long"]
    assert driver.outputs == driver.expected


def itl_driver(max_itl_ms: float, budget: int = 64, ms_per_token: float = 1.0) -> SchedulerDriver:
    """Two streams decoding, the step costs known: 25 ms for their decodes, ``ms_per_token``
    a prompt token."""
    kv_cache = KVCacheManager(128, 4)
    limits = SchedulerLimits(8, budget, 256, True, max_itl_ms=max_itl_ms)
    driver = SchedulerDriver(build_scheduler(ChunkedPrefillPolicy, limits, kv_cache), kv_cache)
    cost = driver.scheduler.step_cost
    cost.observe(2, 0, 0.025)
    cost.observe(2, 10, 0.025 + 10 * ms_per_token / 1000)
    return driver


def step_with_two_decodes_and_a_long_prompt(driver: SchedulerDriver) -> dict[str, int]:
    """Streams a and b start, then a 200-token prompt arrives: that step's tokens."""
    driver.add("a", [1, 2, 3], 20)
    driver.add("b", [4, 5, 6], 20)
    driver.step()
    driver.add("long", list(range(1, 201)), 3)
    return driver.step().scheduler_output.num_scheduled_tokens


def test_a_target_caps_the_prompt_tokens_beside_decodes():
    driver = itl_driver(max_itl_ms=75)
    scheduled = step_with_two_decodes_and_a_long_prompt(driver)
    assert scheduled["a"] == scheduled["b"] == 1
    assert scheduled["long"] == 50  # (75 - 25) ms at 1 ms a token
    driver.run()
    assert driver.outputs == driver.expected


def test_a_step_without_decodes_takes_the_whole_budget_under_a_target():
    driver = itl_driver(max_itl_ms=45)
    driver.add("long", list(range(1, 201)), 3)
    assert driver.step().scheduler_output.num_scheduled_tokens["long"] == 64


def test_a_target_near_the_decodes_still_gives_prompts_a_share_of_the_step():
    driver = itl_driver(max_itl_ms=26)
    scheduled = step_with_two_decodes_and_a_long_prompt(driver)
    # the step may last MIN_STEP_OVER_DECODES times its decodes' 25 ms: 37.5 ms of prompt
    assert scheduled["long"] == int((MIN_STEP_OVER_DECODES - 1) * 25)
    assert driver.scheduler.last_step_stats.num_prefill_tokens == scheduled["long"]


def test_prompt_tokens_that_cost_more_than_that_still_progress_a_block_a_step():
    driver = itl_driver(max_itl_ms=26, ms_per_token=5.0)
    scheduled = step_with_two_decodes_and_a_long_prompt(driver)
    assert scheduled["long"] == MIN_PROMPT_TOKENS_BESIDE_DECODES


def test_without_a_target_or_measurements_the_budget_decides():
    driver = itl_driver(max_itl_ms=45)
    driver.scheduler.step_cost = StepCostModel()  # nothing measured yet
    driver.add("a", [1, 2, 3], 20)
    driver.step()
    driver.add("long", list(range(1, 201)), 3)
    assert driver.step().scheduler_output.num_scheduled_tokens["long"] == 63
    plain = make_driver(max_num_batched_tokens=64)
    assert plain.scheduler.step_cost is None
    plain.add("a", [1, 2, 3], 20)
    plain.step()
    plain.add("long", list(range(1, 201)), 3)
    assert plain.step().scheduler_output.num_scheduled_tokens["long"] == 63


def test_the_engine_feeds_its_steps_times_to_the_target(tmp_path):
    from vlite import LLM, SamplingParams
    from vlite.testing.tiny_models import make_tiny_model

    model = make_tiny_model(tmp_path, "LlamaForCausalLM")
    llm = LLM(model=str(model), max_itl_ms=50, enable_chunked_prefill=True)
    llm.generate(
        ["hello there", "a longer prompt here"], SamplingParams(max_tokens=4), use_tqdm=False
    )
    cost = llm.llm_engine.engine_core.scheduler.step_cost
    assert cost.seconds_per_prompt_token is not None and cost.seconds_per_prompt_token > 0
    assert cost.decode_seconds(2) is not None
