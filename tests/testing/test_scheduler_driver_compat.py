"""SchedulerDriver.step() as plugin authors' tests used it before and after plugin API 5."""

from __future__ import annotations

from vlite.core.outputs import SchedulerOutput
from vlite.plugins.schedulers.fcfs import FcfsPolicy
from vlite.testing.scheduler_driver import DriverStep, SchedulerDriver


def _driver() -> SchedulerDriver:
    driver = SchedulerDriver.create(
        FcfsPolicy, num_blocks=8, block_size=4, max_num_seqs=2, max_num_batched_tokens=16
    )
    driver.add("a", [1, 2, 3, 4, 5], max_tokens=3)
    driver.add("b", [6, 7, 8], max_tokens=3)
    return driver


def test_a_step_reads_as_the_scheduler_output_it_used_to_be():
    """Before: ``so = driver.step()`` was the SchedulerOutput itself."""
    so = _driver().step()
    assert isinstance(so, SchedulerOutput)
    assert so.num_scheduled_tokens == {"a": 5, "b": 3}
    assert [new.request_id for new in so.new_requests] == ["a", "b"]
    assert so.total_num_scheduled_tokens == 8 and not so.is_empty


def test_a_step_also_carries_what_came_back():
    driver = _driver()
    step = driver.step()
    assert isinstance(step, DriverStep) and step.scheduler_output is step
    assert set(step.sampled) == {"a", "b"}
    assert {rid: out.new_token_ids for rid, out in step.outputs.items()} == step.sampled
    assert driver.steps == [step]
