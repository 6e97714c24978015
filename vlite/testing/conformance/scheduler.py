"""SchedulerConformance: the contract every scheduler policy must keep.

Most checks drive the scheduler with :class:`~vlite.testing.scheduler_driver.SchedulerDriver`
(no model, every step checked: token budget, ``max_num_seqs``, worker-side state, block
accounting). One runs a tiny random model through ``LLM`` and compares greedy tokens with
the reference scheduler's (``fcfs``).
"""

from __future__ import annotations

import random
from typing import Any, ClassVar

import pytest

from vlite.core.plugins import registration_problem
from vlite.core.scheduler import Scheduler
from vlite.testing.conformance.base import PluginConformance
from vlite.testing.engine_runs import cached_tiny_model, generate_tokens, mixed_prompts
from vlite.testing.scheduler_driver import SchedulerDriver, expected_output

BLOCK_SIZE = 4


class SchedulerConformance(PluginConformance):
    """Conformance suite for ``register_schedulers`` plugins.

    A :class:`~vlite.core.scheduling_policy.SchedulingPolicy` is run on the core's mechanism
    with chunked prefill both on and off, with preemption and with prefix caching (they
    are the mechanism's, so every policy composes with them). A plugin-API-1
    :class:`~vlite.core.scheduler.Scheduler` subclass is tested for what it claims:
    ``supports_chunked_prefill`` (default ``False``) and ``supports_prefix_caching``
    (default ``True``), overridable here.

    Attributes:
        reference_scheduler: whose greedy tokens the plugin's must equal.
    """

    plugin_kind = "scheduler"
    reference_scheduler: ClassVar[str] = "fcfs"
    capability_defaults: ClassVar[dict[str, bool]] = {
        "supports_chunked_prefill": False,
        "supports_prefix_caching": True,
    }
    supports_chunked_prefill: ClassVar[bool | None] = None
    supports_prefix_caching: ClassVar[bool | None] = None

    def check_interface(self, plugin_cls: Any) -> None:
        problem = registration_problem("scheduler", plugin_cls)
        assert problem is None, f"{plugin_cls!r} {problem}"

    def claims(self, plugin_cls: Any, flag: str) -> bool:
        """A policy object gets every capability from the mechanism; an API-1 subclass
        has what it claims."""
        if getattr(type(self), flag, None) is None and not issubclass(plugin_cls, Scheduler):
            return True
        return super().claims(plugin_cls, flag)

    # ---- helpers -----------------------------------------------------------------------

    def make_driver(self, plugin_cls: Any, **settings: Any) -> SchedulerDriver:
        """A driver with small limits; ``settings`` override them."""
        options = dict(
            num_blocks=64,
            block_size=BLOCK_SIZE,
            max_num_seqs=4,
            max_num_batched_tokens=24,
            max_model_len=256,
            enable_chunked_prefill=self.claims(plugin_cls, "supports_chunked_prefill"),
        )
        options.update(settings)
        return SchedulerDriver.create(plugin_cls, **options)

    def add_workload(
        self,
        driver: SchedulerDriver,
        num_requests: int,
        max_prompt_len: int,
        max_tokens: tuple[int, int] = (1, 10),
        seed: int = 0,
    ) -> list[str]:
        """Random requests: a shared prefix for every third, EOS for every fourth."""
        rng = random.Random(seed)
        prefix = [rng.randrange(1, 900) for _ in range(3 * BLOCK_SIZE)]
        # Every request must fit the cache alone, as the engine requires.
        capacity = driver.kv_cache.num_blocks * BLOCK_SIZE - max_tokens[1]
        max_prompt_len = min(max_prompt_len, capacity, driver.limits.max_model_len - 1)
        request_ids = []
        for index in range(num_requests):
            prompt = [rng.randrange(1, 900) for _ in range(rng.randint(1, max_prompt_len))]
            if index % 3 == 1:
                prompt = (prefix + prompt)[:max_prompt_len]
            num_new = rng.randint(*max_tokens)
            eos = None
            if index % 4 == 3:
                alone = expected_output(prompt, num_new, None, driver.limits.max_model_len)
                eos = alone[rng.randrange(len(alone))]
            request_id = f"req-{seed}-{index}"
            driver.add(request_id, prompt, num_new, eos_token_id=eos, priority=rng.randint(0, 2))
            request_ids.append(request_id)
        return request_ids

    def max_prompt_len(self, plugin_cls: Any, budget: int) -> int:
        """Prompts may exceed the budget only for a scheduler that chunks them."""
        return 3 * budget if self.claims(plugin_cls, "supports_chunked_prefill") else budget

    @staticmethod
    def assert_outputs_as_expected(driver: SchedulerDriver, request_ids: list[str]) -> None:
        for request_id in request_ids:
            assert driver.outputs[request_id] == driver.expected[request_id], (
                f"request {request_id} got tokens {driver.outputs[request_id]}, expected "
                f"{driver.expected[request_id]} (as when run alone)"
            )

    # ---- limits and completion ---------------------------------------------------------

    def test_never_exceeds_token_budget_or_max_num_seqs(self, plugin_cls) -> None:
        driver = self.make_driver(plugin_cls, max_num_seqs=3, max_num_batched_tokens=20)
        request_ids = self.add_workload(driver, 14, self.max_prompt_len(plugin_cls, 20))
        driver.run()  # every step asserts both limits
        assert driver.max_scheduled_tokens > 0
        self.assert_outputs_as_expected(driver, request_ids)

    def test_whole_prompts_without_chunked_prefill(self, plugin_cls) -> None:
        if issubclass(plugin_cls, Scheduler) and self.claims(
            plugin_cls, "supports_chunked_prefill"
        ):
            pytest.skip("an API-1 subclass that claims chunking may chunk whatever the setting")
        driver = self.make_driver(
            plugin_cls, max_num_seqs=3, max_num_batched_tokens=20, enable_chunked_prefill=False
        )
        request_ids = self.add_workload(driver, 14, 20, seed=6)
        driver.run()  # a partial prompt fails the step it is scheduled in
        assert driver.num_chunked_steps == 0
        self.assert_outputs_as_expected(driver, request_ids)

    def test_every_request_finishes_with_its_own_tokens(self, plugin_cls) -> None:
        driver = self.make_driver(plugin_cls, max_model_len=28)
        request_ids = self.add_workload(driver, 10, 16, max_tokens=(1, 12), seed=1)
        # One request reaches max_model_len before max_tokens.
        driver.add("long", list(range(1, 23)), 10)
        request_ids.append("long")
        driver.run()
        self.assert_outputs_as_expected(driver, request_ids)
        for request_id in request_ids:
            expected = driver.expected[request_id]
            is_eos = expected[-1] == driver.eos_token_ids[request_id]
            assert driver.finish_reasons.get(request_id) == ("stop" if is_eos else "length"), (
                f"request {request_id} finished with {driver.finish_reasons.get(request_id)!r}"
            )
        assert driver.finish_reasons["long"] == "length"
        assert len(driver.outputs["long"]) == 28 - 22

    # ---- preemption --------------------------------------------------------------------

    def test_preemption_frees_blocks_and_later_restores_requests(self, plugin_cls) -> None:
        # Each request fits alone (at most 4 blocks), but not all of them together.
        driver = self.make_driver(plugin_cls, num_blocks=10, max_num_batched_tokens=64)
        requests = [
            driver.add(f"p{index}", [10 * index + offset + 1 for offset in range(7)], 8)
            for index in range(5)
        ]
        driver.run()  # a request seen preempted while holding blocks fails that step
        preempted = [r.request_id for r in requests if r.num_preemptions]
        assert preempted, "no request was preempted although the blocks ran out"
        assert driver.preempted_ids <= set(preempted)
        # Restored: each preempted request was recomputed and completed its own tokens.
        self.assert_outputs_as_expected(driver, [r.request_id for r in requests])
        driver.check_all_finished_cleanly()

    # ---- block leaks and abort ---------------------------------------------------------

    def test_no_block_leaks_after_finish(self, plugin_cls) -> None:
        driver = self.make_driver(plugin_cls, num_blocks=24, max_num_batched_tokens=32)
        request_ids = self.add_workload(driver, 12, self.max_prompt_len(plugin_cls, 32), seed=2)
        driver.run()
        driver.check_all_finished_cleanly()
        assert sorted(driver.reported_finished) == sorted(request_ids), (
            "finished_request_ids must name each finished request exactly once"
        )

    def test_no_block_leaks_after_abort(self, plugin_cls) -> None:
        driver = self.make_driver(plugin_cls, num_blocks=16, max_num_seqs=3)
        request_ids = self.add_workload(driver, 9, 20, max_tokens=(6, 12), seed=3)
        driver.step()
        driver.step()
        running = [r.request_id for r in driver.scheduler.running]
        waiting = [r.request_id for r in driver.scheduler.waiting]
        assert running and waiting, "the workload should leave requests running and waiting"
        aborted = [running[0], waiting[-1]]
        driver.abort(aborted)
        driver.run()
        driver.check_all_finished_cleanly()
        remaining = [r for r in request_ids if r not in aborted]
        self.assert_outputs_as_expected(driver, remaining)
        assert sorted(driver.reported_finished) == sorted(request_ids)

    def test_abort_is_idempotent(self, plugin_cls) -> None:
        driver = self.make_driver(plugin_cls, num_blocks=32)
        request_ids = self.add_workload(driver, 6, 16, max_tokens=(4, 8), seed=4)
        driver.step()
        target = driver.scheduler.running[0].request_id
        driver.abort([target])
        num_free = driver.kv_cache.num_free_blocks
        driver.abort([target, target, "no-such-request"])  # again, twice, and unknown
        assert driver.kv_cache.num_free_blocks == num_free, "a repeated abort freed blocks"
        driver.run()
        finished = [r for r in request_ids if r != target]
        driver.abort(finished)  # aborting finished requests changes nothing
        driver.check_all_finished_cleanly()
        self.assert_outputs_as_expected(driver, finished)
        assert all(driver.finish_reasons[r] != "abort" for r in finished)
        assert driver.finish_reasons[target] == "abort"
        assert driver.reported_finished.count(target) == 1

    # ---- optional capabilities ---------------------------------------------------------

    def test_prompt_chunks_respect_the_budget(self, plugin_cls) -> None:
        self.require(plugin_cls, "supports_chunked_prefill")
        driver = self.make_driver(plugin_cls, max_num_batched_tokens=16, num_blocks=96)
        request_ids = self.add_workload(driver, 6, 60, seed=5)
        driver.add("huge", list(range(1, 101)), 4)
        driver.run()
        assert driver.num_chunked_steps > 0, "a 100-token prompt fit a 16-token budget unsplit"
        self.assert_outputs_as_expected(driver, [*request_ids, "huge"])
        driver.check_all_finished_cleanly()

    def test_reuses_prefix_cached_blocks(self, plugin_cls) -> None:
        self.require(plugin_cls, "supports_prefix_caching")
        driver = self.make_driver(plugin_cls)
        shared = list(range(1, 3 * BLOCK_SIZE + 1))
        driver.add("first", [*shared, 500], 3)
        driver.run()
        second = driver.add("second", [*shared, 600, 601], 3)
        driver.run()
        assert second.num_cached_tokens == 3 * BLOCK_SIZE, (
            f"the second request reused {second.num_cached_tokens} cached tokens, "
            f"expected {3 * BLOCK_SIZE} (three full shared blocks)"
        )
        self.assert_outputs_as_expected(driver, ["first", "second"])

    # ---- end to end --------------------------------------------------------------------

    @pytest.fixture(scope="class")
    @classmethod
    def scheduler_model(cls) -> str:
        return str(cached_tiny_model("LlamaForCausalLM"))

    @pytest.fixture(scope="class")
    @classmethod
    def scheduler_prompts(cls) -> list:
        return mixed_prompts(num_prompts=10, max_prompt_len=40, shared_prefix_len=12)

    @classmethod
    def engine_settings(cls, **overrides: Any) -> dict[str, Any]:
        """Small blocks and cache so runs batch, hit the prefix cache and preempt."""
        settings = dict(
            block_size=BLOCK_SIZE,
            num_kv_blocks=28,
            max_num_seqs=4,
            max_num_batched_tokens=64,
            enable_prefix_caching=True,
            seed=0,
        )
        settings.update(overrides)
        return settings

    @pytest.fixture(scope="class")
    @classmethod
    def reference_tokens(cls, plugin_registry, scheduler_model, scheduler_prompts) -> list:
        from vlite.engine.llm import LLM

        llm = LLM(
            model=scheduler_model,
            registry=plugin_registry,
            scheduler=cls.reference_scheduler,
            **cls.engine_settings(),
        )
        return generate_tokens(llm, scheduler_prompts)

    def test_greedy_tokens_equal_the_reference_scheduler(
        self,
        plugin_cls,
        plugin_registry,
        conformance_plugin_name,
        scheduler_model,
        scheduler_prompts,
        reference_tokens,
    ) -> None:
        from vlite.engine.llm import LLM

        overrides: dict[str, Any] = {}
        if self.claims(plugin_cls, "supports_chunked_prefill"):
            overrides["max_num_batched_tokens"] = 16  # prompts of up to 40 tokens get chunked
            overrides["enable_chunked_prefill"] = True
        llm = LLM(
            model=scheduler_model,
            registry=plugin_registry,
            scheduler=conformance_plugin_name,
            **self.engine_settings(**overrides),
        )
        tokens = generate_tokens(llm, scheduler_prompts)
        for index, (got, expected) in enumerate(zip(tokens, reference_tokens)):
            assert got == expected, (
                f"prompt {index}: scheduler {conformance_plugin_name!r} produced {got}, "
                f"{self.reference_scheduler!r} produced {expected}"
            )
