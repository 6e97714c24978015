"""Shared helpers for the core tests: requests, and a scheduler driven by a fake model."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from vlite.core.kv_cache import KVCacheManager
from vlite.core.outputs import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput
from vlite.core.request import EngineCoreRequest, Request
from vlite.core.sampling_params import SamplingParams
from vlite.core.scheduler import Scheduler, SchedulerLimits
from vlite.plugins.schedulers.fcfs import FcfsScheduler

#: Fake "sampled" tokens start here, far from any EOS or prompt token used in the tests.
FIRST_FAKE_TOKEN = 1000


def make_request(
    request_id: str, prompt_token_ids: list[int], eos_token_id: int | None = None, **params
) -> Request:
    params.setdefault("max_tokens", 16)
    return Request(
        EngineCoreRequest(
            request_id, list(prompt_token_ids), SamplingParams(**params), eos_token_id
        )
    )


def next_fake_token(request: Request) -> int:
    """The default fake model: emits 1000, 1001, ... for each request."""
    return FIRST_FAKE_TOKEN + request.num_output_tokens


@dataclass
class StepResult:
    scheduler_output: SchedulerOutput
    outputs: dict[str, EngineCoreOutput]
    sampled: dict[str, list[int]]


@dataclass
class FakeEngine:
    """A scheduler (FCFS unless told otherwise) and KV cache driven without a model.

    Each step schedules, "samples" one token for every scheduled request that reaches the
    end of its known tokens, and feeds that back to ``update_from_output``. It also plays
    the worker: it applies every SchedulerOutput diff to its own per-request state and
    checks that state (tokens, block table, computed tokens) against the scheduler's.
    Every step asserts the scheduler's limits and the KV cache's block accounting.
    """

    scheduler: Scheduler
    kv: KVCacheManager
    next_token: Callable[[Request], int] = next_fake_token
    steps: list[StepResult] = field(default_factory=list)
    # Worker-side mirror: request_id -> [token_ids, block_ids, num_computed_tokens].
    worker: dict[str, list] = field(default_factory=dict)

    @property
    def limits(self) -> SchedulerLimits:
        return self.scheduler.limits

    def add(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        eos_token_id: int | None = None,
        **params,
    ) -> Request:
        """Add a request (``params`` are SamplingParams fields; max_tokens defaults to 16)."""
        request = make_request(request_id, prompt_token_ids, eos_token_id, **params)
        self.scheduler.add_request(request)
        return request

    def step(self) -> StepResult:
        so = self.scheduler.schedule()
        self._check_limits(so)
        self._apply_to_worker(so)
        sampled: dict[str, list[int]] = {}
        for request_id, num_new in so.num_scheduled_tokens.items():
            request = self.scheduler.requests[request_id]
            if request.num_computed_tokens + num_new == request.num_tokens:
                sampled[request_id] = [self.next_token(request)]
        for request_id, token_ids in sampled.items():
            self.worker[request_id][0] += token_ids
        out = self.scheduler.update_from_output(so, ModelRunnerOutput(sampled))
        result = StepResult(so, {o.request_id: o for o in out.outputs}, sampled)
        self.steps.append(result)
        self.check_block_accounting()
        return result

    def run(self, max_steps: int = 200) -> list[StepResult]:
        """Step until every request has finished."""
        for _ in range(max_steps):
            if not self.scheduler.has_unfinished_requests():
                return self.steps
            self.step()
        raise AssertionError(f"requests still unfinished after {max_steps} steps")

    def _check_limits(self, so: SchedulerOutput) -> None:
        assert so.total_num_scheduled_tokens <= self.limits.max_num_batched_tokens
        assert len(so.num_scheduled_tokens) <= self.limits.max_num_seqs
        assert len(self.scheduler.running) <= self.limits.max_num_seqs
        assert all(n > 0 for n in so.num_scheduled_tokens.values())
        for request_id, num_new in so.num_scheduled_tokens.items():
            request = self.scheduler.requests[request_id]
            assert request in self.scheduler.running
            assert request.num_computed_tokens + num_new <= request.num_tokens
            # The request's blocks hold every token computed by the end of this step.
            num_held = len(self.kv.block_ids_of(request_id))
            assert num_held >= self.kv.num_blocks_for(request.num_computed_tokens + num_new)
            assert request.block_ids == self.kv.block_ids_of(request_id)

    def _apply_to_worker(self, so: SchedulerOutput) -> None:
        for request_id in so.finished_request_ids:
            self.worker.pop(request_id, None)
        for new in so.new_requests:
            assert new.request_id not in self.worker
            self.worker[new.request_id] = [
                list(new.token_ids),
                list(new.block_ids),
                new.num_computed_tokens,
            ]
        for cached in so.cached_requests:
            state = self.worker[cached.request_id]
            if cached.is_resumed:  # the new blocks replace the table
                state[1] = list(cached.new_block_ids)
            else:
                state[1] += cached.new_block_ids
            state[2] = cached.num_computed_tokens
        for request_id in so.num_scheduled_tokens:
            request = self.scheduler.requests[request_id]
            token_ids, block_ids, num_computed = self.worker[request_id]
            assert token_ids == request.all_token_ids
            assert block_ids == request.block_ids
            assert num_computed == request.num_computed_tokens

    def check_block_accounting(self) -> None:
        """Every block is either free or held, with ref counts matching the holders."""
        holders: dict[int, int] = {}
        for request_id in self.scheduler.requests:
            for block_id in self.kv.block_ids_of(request_id):
                holders[block_id] = holders.get(block_id, 0) + 1
        assert len(holders) + self.kv.num_free_blocks == self.kv.num_blocks
        for block in self.kv.blocks:
            assert block.ref_count == holders.get(block.block_id, 0)


@pytest.fixture
def make_engine() -> Callable[..., FakeEngine]:
    """Factory: ``make_engine(num_blocks=.., block_size=.., max_num_seqs=.., ...)``."""

    def factory(
        num_blocks: int = 64,
        block_size: int = 4,
        max_num_seqs: int = 8,
        max_num_batched_tokens: int = 64,
        max_model_len: int = 256,
        enable_prefix_caching: bool = True,
        next_token: Callable[[Request], int] = next_fake_token,
        scheduler_cls: type[Scheduler] = FcfsScheduler,
    ) -> FakeEngine:
        kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching)
        limits = SchedulerLimits(max_num_seqs, max_num_batched_tokens, max_model_len)
        return FakeEngine(scheduler_cls(limits, kv), kv, next_token)

    return factory
