"""Drive a scheduler without a model, checking its contract at every step.

:class:`SchedulerDriver` plays the rest of the engine around a scheduler: it calls
``schedule()``, applies the SchedulerOutput diff to its own worker-side mirror of every
request (as a model runner does), "samples" with a fake model that is a deterministic
function of a sequence's tokens, and feeds the tokens back through
``update_from_output()``. Every step it asserts the limits (token budget, ``max_num_seqs``),
that the scheduler and the worker mirror agree, and the KV cache's block accounting.

The default fake model's next token depends on the sequence (so a scheduler that mixed two
requests up would change their tokens) and :func:`expected_output` says what a request
generates alone; a test may pass its own ``next_token(request)`` instead.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from vlite.core.kv_cache import KVCacheManager
from vlite.core.outputs import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput
from vlite.core.request import EngineCoreRequest, Request, RequestStatus
from vlite.core.sampling_params import SamplingParams
from vlite.core.scheduler import Scheduler, SchedulerLimits, build_scheduler
from vlite.core.structured_output_manager import StructuredOutputManager

#: Fake tokens are at least this, far from the prompt tokens the suites use.
FIRST_FAKE_TOKEN = 1000


def fake_next_token(token_ids: Sequence[int]) -> int:
    """The fake model: the next token of a sequence, from its length and last tokens."""
    return FIRST_FAKE_TOKEN + (len(token_ids) * 7 + sum(token_ids[-3:]) * 13) % 500


def expected_output(
    prompt_token_ids: Sequence[int],
    max_tokens: int,
    eos_token_id: int | None,
    max_model_len: int,
) -> list[int]:
    """What the fake model generates for a request run alone."""
    tokens = list(prompt_token_ids)
    output: list[int] = []
    while len(output) < max_tokens and len(tokens) < max_model_len:
        token = fake_next_token(tokens)
        tokens.append(token)
        output.append(token)
        if token == eos_token_id:
            break
    return output


@dataclass
class _WorkerState:
    token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int


class DriverStep(SchedulerOutput):
    """One step as the driver ran it: the step's :class:`SchedulerOutput` (it is one, as
    ``SchedulerDriver.step()`` returned before plugin API 5, so ``step.num_scheduled_tokens``
    still reads), plus what came back.

    Attributes:
        outputs: request id -> what ``update_from_output`` returned for it this step.
        sampled: request id -> the tokens the fake model sampled for it this step.
    """

    outputs: dict[str, EngineCoreOutput] = msgspec.field(default_factory=dict)
    sampled: dict[str, list[int]] = msgspec.field(default_factory=dict)

    @classmethod
    def of(
        cls,
        scheduler_output: SchedulerOutput,
        outputs: dict[str, EngineCoreOutput],
        sampled: dict[str, list[int]],
    ) -> DriverStep:
        fields = {
            name: getattr(scheduler_output, name) for name in SchedulerOutput.__struct_fields__
        }
        return cls(**fields, outputs=outputs, sampled=sampled)

    @property
    def scheduler_output(self) -> SchedulerOutput:
        """The step's scheduler output (this object itself)."""
        return self


@dataclass
class SchedulerDriver:
    """A scheduler and its KV cache, run by a fake model; see the module docstring.

    Attributes:
        next_token: ``next_token(request)`` replaces the default fake model (``expected``
            then stays empty).
        steps: every :class:`DriverStep` so far.
        outputs: request id -> tokens delivered so far.
        expected: request id -> the tokens it generates when run alone (default model).
        finish_reasons: request id -> ``finish_reason`` of a finished request.
        preempted_ids: requests seen in the ``PREEMPTED`` state after some step.
        reported_finished: request ids in the order ``finished_request_ids`` named them.
        num_chunked_steps: scheduled entries that computed part of the pending tokens.
    """

    scheduler: Scheduler
    kv_cache: KVCacheManager
    next_token: Callable[[Request], int] | None = None
    steps: list[DriverStep] = field(default_factory=list)
    outputs: dict[str, list[int]] = field(default_factory=dict)
    finish_reasons: dict[str, str] = field(default_factory=dict)
    expected: dict[str, list[int]] = field(default_factory=dict)
    eos_token_ids: dict[str, int | None] = field(default_factory=dict)
    preempted_ids: set[str] = field(default_factory=set)
    reported_finished: list[str] = field(default_factory=list)
    num_steps: int = 0
    num_chunked_steps: int = 0
    max_scheduled_tokens: int = 0
    _worker: dict[str, _WorkerState] = field(default_factory=dict)
    _ended: set[str] = field(default_factory=set)

    @classmethod
    def create(
        cls,
        scheduler_cls: type,
        *,
        num_blocks: int = 64,
        block_size: int = 4,
        max_num_seqs: int = 8,
        max_num_batched_tokens: int = 64,
        max_model_len: int = 256,
        enable_prefix_caching: bool = True,
        enable_chunked_prefill: bool | None = None,
        long_prefill_token_threshold: int = 0,
        next_token: Callable[[Request], int] | None = None,
        sliding_window: int | None = None,
        recompute_past_length: int | None = None,
        structured_outputs: StructuredOutputManager | None = None,
    ) -> SchedulerDriver:
        """A driver for a registered scheduler class (a ``SchedulingPolicy`` subclass, or
        an API-1 ``Scheduler`` subclass), built as the engine builds it (``sliding_window``:
        the KV-cache manager releases blocks outside it; ``recompute_past_length``: see
        :class:`~vlite.core.scheduler.SchedulerLimits`; ``structured_outputs``: compiles
        the grammars of requests that have one)."""
        kv_cache = KVCacheManager(num_blocks, block_size, enable_prefix_caching, sliding_window)
        limits = SchedulerLimits(
            max_num_seqs,
            max_num_batched_tokens,
            max_model_len,
            enable_chunked_prefill,
            long_prefill_token_threshold,
            recompute_past_length,
        )
        scheduler = build_scheduler(scheduler_cls, limits, kv_cache, structured_outputs)
        return cls(scheduler, kv_cache, next_token)

    @property
    def limits(self) -> SchedulerLimits:
        return self.scheduler.limits

    @property
    def allows_chunking(self) -> bool:
        return self.scheduler.chunks_prefills

    # ---- requests ----------------------------------------------------------------------

    def add(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        max_tokens: int = 16,
        *,
        eos_token_id: int | None = None,
        priority: int = 0,
        **sampling: Any,
    ) -> Request:
        """Add a request; ``sampling`` holds further ``SamplingParams`` fields (``stop``,
        ``min_tokens``, ...)."""
        self._check_fits(request_id, len(prompt_token_ids), max_tokens)
        params = SamplingParams(max_tokens=max_tokens, **sampling)
        core = EngineCoreRequest(
            request_id, list(prompt_token_ids), params, eos_token_id, priority=priority
        )
        request = Request(core)
        self.scheduler.add_request(request)
        self.outputs[request_id] = []
        self.eos_token_ids[request_id] = eos_token_id
        if self.next_token is None:
            self.expected[request_id] = expected_output(
                prompt_token_ids, max_tokens, eos_token_id, self.limits.max_model_len
            )
        return request

    def _check_fits(self, request_id: str, num_prompt: int, max_tokens: int) -> None:
        """Refuse what ``EngineCore.add_request`` refuses: requests that can never run."""
        limits = self.limits
        if not 0 < num_prompt < limits.max_model_len:
            raise ValueError(f"{request_id}: {num_prompt} prompt tokens do not fit the model")
        if num_prompt > limits.max_num_batched_tokens and not self.allows_chunking:
            raise ValueError(f"{request_id}: the prompt exceeds the token budget")
        num_total = min(num_prompt + max_tokens, limits.max_model_len)
        step_tokens = limits.max_num_batched_tokens if self.allows_chunking else None
        if self.kv_cache.max_blocks_held(num_total, step_tokens) > self.kv_cache.num_blocks:
            raise ValueError(f"{request_id}: may need more blocks than the cache has")

    def abort(self, request_ids: list[str]) -> None:
        """Abort as the engine does; then check that their blocks went back."""
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
        for request_id in request_ids:
            if request_id in self.outputs and request_id not in self.finish_reasons:
                self.finish_reasons[request_id] = "abort"
            self._ended.add(request_id)
            assert request_id not in self.scheduler.requests, f"aborted {request_id} remains"
            assert self.kv_cache.block_ids_of(request_id) == [], (
                f"aborted request {request_id} still holds blocks"
            )
        self.check_block_accounting()

    # ---- stepping ----------------------------------------------------------------------

    def step(self) -> DriverStep:
        so = self.scheduler.schedule()
        self.num_steps += 1
        self._check_scheduled(so)
        self._apply_to_worker(so)
        sampled: dict[str, list[int]] = {}
        for request_id, num_new in so.num_scheduled_tokens.items():
            state = self._worker[request_id]
            state.num_computed_tokens += num_new
            if state.num_computed_tokens == len(state.token_ids):
                if self.next_token is None:
                    token = fake_next_token(state.token_ids)
                else:
                    token = self.next_token(self.scheduler.requests[request_id])
                state.token_ids.append(token)
                sampled[request_id] = [token]
        engine_outputs = self.scheduler.update_from_output(so, ModelRunnerOutput(sampled))
        step = DriverStep.of(so, {o.request_id: o for o in engine_outputs.outputs}, sampled)
        self.steps.append(step)
        for output in engine_outputs.outputs:
            assert output.request_id not in self.finish_reasons, (
                f"request {output.request_id} produced output after it finished"
            )
            self.outputs[output.request_id] += output.new_token_ids
            if output.finish_reason is not None:
                self.finish_reasons[output.request_id] = output.finish_reason
                self._ended.add(output.request_id)
        self._record_preempted()
        self.check_block_accounting()
        return step

    def run(self, max_steps: int = 500) -> list[DriverStep]:
        """Step until every request finished; fails if that takes more than ``max_steps``.
        Returns every step so far."""
        for _ in range(max_steps):
            if not self.scheduler.has_unfinished_requests():
                return self.steps
            self.step()
        unfinished = sorted(self.scheduler.requests)
        raise AssertionError(f"requests {unfinished} unfinished after {max_steps} steps")

    # ---- checks ------------------------------------------------------------------------

    def _check_scheduled(self, so: SchedulerOutput) -> None:
        limits = self.limits
        total = so.total_num_scheduled_tokens
        self.max_scheduled_tokens = max(self.max_scheduled_tokens, total)
        assert total <= limits.max_num_batched_tokens, (
            f"step {self.num_steps} scheduled {total} tokens, over the budget of "
            f"{limits.max_num_batched_tokens}"
        )
        assert len(so.num_scheduled_tokens) <= limits.max_num_seqs, (
            f"step {self.num_steps} scheduled {len(so.num_scheduled_tokens)} requests, over "
            f"max_num_seqs={limits.max_num_seqs}"
        )
        assert len(self.scheduler.running) <= limits.max_num_seqs
        if so.is_empty and not so.num_preempted:
            assert not self.scheduler.has_unfinished_requests(), (
                f"step {self.num_steps} scheduled nothing with requests "
                f"{sorted(self.scheduler.requests)} unfinished (the engine would fail)"
            )
        for request_id in so.finished_request_ids:
            self.reported_finished.append(request_id)
        for request_id, num_new in so.num_scheduled_tokens.items():
            self._check_scheduled_request(request_id, num_new)

    def _check_scheduled_request(self, request_id: str, num_new: int) -> None:
        assert request_id not in self._ended, f"finished request {request_id} was scheduled"
        request = self.scheduler.requests.get(request_id)
        assert request is not None, f"unknown request {request_id} was scheduled"
        assert request.status is RequestStatus.RUNNING and request in self.scheduler.running
        assert num_new > 0, f"request {request_id} scheduled for {num_new} tokens"
        num_pending = request.num_tokens - request.num_computed_tokens
        assert num_new <= num_pending, f"{request_id}: {num_new} tokens of {num_pending} pending"
        if num_new < num_pending:
            assert self.allows_chunking, (
                f"request {request_id} got {num_new} of {num_pending} pending tokens, but the "
                "chunked prefill is off"
            )
            self.num_chunked_steps += 1
        num_needed = self.kv_cache.num_blocks_for(request.num_computed_tokens + num_new)
        held = self.kv_cache.block_ids_of(request_id)
        assert len(held) >= num_needed, f"{request_id} holds {len(held)} < {num_needed} blocks"

    def _apply_to_worker(self, so: SchedulerOutput) -> None:
        for request_id in so.finished_request_ids:
            self._worker.pop(request_id, None)
        for new in so.new_requests:
            assert new.request_id not in self._worker, f"{new.request_id} sent as new twice"
            self._worker[new.request_id] = _WorkerState(
                list(new.token_ids), list(new.block_ids), new.num_computed_tokens
            )
        for cached in so.cached_requests:
            assert cached.request_id in self._worker, f"{cached.request_id} never sent as new"
            state = self._worker[cached.request_id]
            if cached.is_resumed:
                state.block_ids = list(cached.new_block_ids)
            else:
                if cached.num_kept_blocks is not None:  # blocks of rejected drafts went back
                    del state.block_ids[cached.num_kept_blocks :]
                state.block_ids += cached.new_block_ids
            state.num_computed_tokens = cached.num_computed_tokens
        for request_id in so.num_scheduled_tokens:
            request = self.scheduler.requests[request_id]
            state = self._worker.get(request_id)
            assert state is not None, f"{request_id} scheduled but never sent to the worker"
            assert state.token_ids == request.all_token_ids, f"{request_id}: tokens differ"
            held = self.kv_cache.block_ids_of(request_id)
            assert state.block_ids == held, f"{request_id}: worker's blocks differ from the cache's"
            assert state.num_computed_tokens == request.num_computed_tokens

    def _record_preempted(self) -> None:
        for request_id, request in self.scheduler.requests.items():
            if request.status is RequestStatus.PREEMPTED:
                self.preempted_ids.add(request_id)
                assert self.kv_cache.block_ids_of(request_id) == [], (
                    f"preempted request {request_id} still holds blocks"
                )

    def check_block_accounting(self) -> None:
        """Every block is free or held, with reference counts equal to its holders."""
        holders: dict[int, int] = {}
        for request_id in self.scheduler.requests:
            for block_id in self.kv_cache.held_block_ids_of(request_id):
                holders[block_id] = holders.get(block_id, 0) + 1
        assert len(holders) + self.kv_cache.num_free_blocks == self.kv_cache.num_blocks, (
            f"{self.kv_cache.num_blocks} blocks, {len(holders)} held by live requests, "
            f"{self.kv_cache.num_free_blocks} free: blocks leaked"
        )
        for block in self.kv_cache.blocks:
            assert block.ref_count == holders.get(block.block_id, 0), (
                f"block {block.block_id} has ref_count {block.ref_count}, "
                f"held by {holders.get(block.block_id, 0)} live requests"
            )

    def check_all_finished_cleanly(self) -> None:
        """No request, block or queue entry is left once every request has finished."""
        assert not self.scheduler.has_unfinished_requests()
        assert not self.scheduler.waiting and not self.scheduler.running
        assert self.kv_cache.num_free_blocks == self.kv_cache.num_blocks, "blocks leaked"
        assert all(block.ref_count == 0 for block in self.kv_cache.blocks)
        flushed = self.scheduler.schedule()  # reports the last finished requests
        assert flushed.is_empty, "a step with no unfinished requests scheduled something"
        self.reported_finished += flushed.finished_request_ids
