"""The scheduling mechanism every scheduler policy shares.

:class:`Scheduler` owns the mechanism: the waiting queue and running list, the per-step
token budget and ``max_num_seqs``, block allocation with prefix-cache lookups, recompute
preemption, and turning sampled tokens into finished requests. A policy plugin subclasses
it and answers three questions (DESIGN §3):

* :meth:`Scheduler.waiting_sort_key` — in which order are waiting requests admitted?
* :meth:`Scheduler.choose_victim` — which running request is preempted when blocks run out?
* :meth:`Scheduler.num_tokens_to_schedule` — how many of a request's pending tokens fit
  in what is left of the budget (all of them, a chunk, or none)?

and, optionally, two more (the defaults keep the order and never preempt for arrivals):

* :meth:`Scheduler.running_order` — in which order do running requests claim the budget?
* :meth:`Scheduler.should_preempt_for` — may a waiting request that cannot get blocks
  take them from a running one?

Every ``schedule()`` also leaves a :class:`~vlite.core.stats.StepStats` in
``last_step_stats``: the batch's make-up and why requests were held back.
"""

from __future__ import annotations

import bisect
import itertools
from abc import ABC, abstractmethod
from dataclasses import dataclass

from vlite.core.kv_cache import KVCacheManager
from vlite.core.outputs import (
    CachedRequestData,
    EngineCoreOutput,
    EngineCoreOutputs,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from vlite.core.request import Request, RequestStatus
from vlite.core.stats import StepStats
from vlite.core.stop import check_stop


@dataclass(frozen=True)
class SchedulerLimits:
    """The limits a scheduler enforces every step."""

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int


class Scheduler(ABC):
    """Shared mechanism; subclasses supply the policy. Registered with ``register_schedulers``.

    Args:
        limits: per-step limits.
        kv_cache_manager: the block manager of the engine's KV cache.
    """

    # Capability flags: what the policy claims; the conformance suite
    # (vlite.testing.SchedulerConformance) tests what is claimed and skips the rest.
    #: Whether the policy may schedule part of a prompt (the engine reads it too).
    supports_chunked_prefill = False
    #: Whether the policy preempts running requests when blocks run out.
    supports_preemption = True
    #: Whether admission reuses prefix-cached blocks (the shared mechanism does).
    supports_prefix_caching = True

    def __init__(self, limits: SchedulerLimits, kv_cache_manager: KVCacheManager) -> None:
        self.limits = limits
        self.kv_cache_manager = kv_cache_manager
        self.requests: dict[str, Request] = {}
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self._arrival_counter = itertools.count()
        self._arrival_index: dict[str, int] = {}
        self._finished_since_last_step: list[str] = []
        self.num_preemptions = 0
        self.num_steps = 0
        self.last_step_stats: StepStats | None = None

    # ---- policy --------------------------------------------------------------------

    @abstractmethod
    def waiting_sort_key(self, request: Request) -> tuple:
        """Sort key of a waiting request: the smallest is admitted first."""

    @abstractmethod
    def choose_victim(self, running: list[Request]) -> Request:
        """The running request to preempt when a step runs out of blocks."""

    def num_tokens_to_schedule(self, request: Request, num_pending: int, budget: int) -> int:
        """How many of ``num_pending`` tokens to compute this step with ``budget`` left.

        The default runs a request's pending tokens all at once or not at all.
        """
        return num_pending if num_pending <= budget else 0

    def running_order(self, running: list[Request]) -> list[Request]:
        """The order in which running requests are scheduled (and claim the budget).

        Returns a new list (``running`` itself must not be changed); the default keeps
        admission order. It does not change ``self.running``, which
        :meth:`choose_victim` sees.
        """
        return list(running)

    def should_preempt_for(self, request: Request, running: list[Request]) -> Request | None:
        """The running request to preempt so that waiting ``request`` can be admitted.

        Called when ``request``, next in the waiting queue, cannot get its KV blocks and no
        preemption happened earlier in the step. ``running`` holds the candidates: running
        requests not admitted in this step, less those already named for this admission.
        The mechanism asks again (without the named request) until the named requests
        would free enough blocks, then preempts them all; ``None`` (the default) ends the
        asking. If the named requests would not free enough, none is preempted and
        ``request`` waits for blocks to free up.
        """
        return None

    def arrival_index(self, request: Request) -> int:
        """Order in which requests were added (ties in every policy go by it)."""
        return self._arrival_index[request.request_id]

    # ---- requests in and out -------------------------------------------------------

    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self._arrival_index[request.request_id] = next(self._arrival_counter)
        self._enqueue_waiting(request)

    def _enqueue_waiting(self, request: Request) -> None:
        bisect.insort(self.waiting, request, key=self.waiting_sort_key)

    def finish_requests(self, request_ids: list[str], status: RequestStatus) -> None:
        """End requests from outside the step (abort, stop string). Unknown ids are ignored."""
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None or request.is_finished:
                continue
            if request in self.running:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            request.status = status
            self._release(request)

    def _release(self, request: Request) -> None:
        # Blocks allocated for a step that never completed (a failed step, then an abort)
        # were published to the prefix cache but never written: free them as uncomputed.
        self.kv_cache_manager.free(request, num_computed_tokens=request.num_computed_tokens)
        request.block_ids = []
        del self.requests[request.request_id]
        del self._arrival_index[request.request_id]
        self._finished_since_last_step.append(request.request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.requests)

    # ---- schedule ------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Choose this step's batch: running requests first, then admissions."""
        step = _StepPlan(budget=self.limits.max_num_batched_tokens)
        kv = self.kv_cache_manager
        num_queried, num_hit = kv.num_prefix_queried_tokens, kv.num_prefix_hit_tokens
        self._schedule_running(step)
        if not step.num_preempted:
            self._schedule_waiting(step)
        finished, self._finished_since_last_step = self._finished_since_last_step, []
        self.last_step_stats = StepStats(
            step_index=self.num_steps,
            num_prefill_requests=step.num_prefill_requests,
            num_decode_requests=len(step.num_scheduled_tokens) - step.num_prefill_requests,
            num_prefill_tokens=step.num_prefill_tokens,
            num_decode_tokens=step.num_decode_tokens,
            token_budget=self.limits.max_num_batched_tokens,
            num_running_requests=len(self.running),
            num_waiting_requests=len(self.waiting),
            num_kv_blocks_used=kv.num_used_blocks,
            num_kv_blocks_free=kv.num_free_blocks,
            num_prefix_cache_queried_tokens=kv.num_prefix_queried_tokens - num_queried,
            num_prefix_cache_hit_tokens=kv.num_prefix_hit_tokens - num_hit,
            num_preemptions=step.num_preempted,
            num_waits_no_blocks=step.num_waits_no_blocks,
            num_waits_budget=step.num_waits_budget,
            num_waits_max_num_seqs=step.num_waits_max_num_seqs,
        )
        self.num_steps += 1
        return SchedulerOutput(
            new_requests=step.new_requests,
            cached_requests=step.cached_requests,
            num_scheduled_tokens=step.num_scheduled_tokens,
            finished_request_ids=finished,
            num_preempted=step.num_preempted,
        )

    def _schedule_running(self, step: _StepPlan) -> None:
        is_budget_spent = False
        for request in self.running_order(self.running):
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            num_pending = request.num_tokens - request.num_computed_tokens
            num_new = self.num_tokens_to_schedule(request, num_pending, step.budget)
            if num_new == 0:
                is_budget_spent = True
                continue
            new_block_ids = self._allocate_or_preempt(request, num_new, step)
            if new_block_ids is None:
                continue
            request.block_ids = request.block_ids + new_block_ids
            step.cached_requests.append(
                CachedRequestData(request.request_id, new_block_ids, request.num_computed_tokens)
            )
            step.add(request, num_new)
        step.num_waits_budget += is_budget_spent

    def _allocate_or_preempt(
        self, request: Request, num_new: int, step: _StepPlan
    ) -> list[int] | None:
        while True:
            new_block_ids = self.kv_cache_manager.allocate_slots(request, num_new)
            if new_block_ids is not None:
                return new_block_ids
            victim = self.choose_victim(self.running)
            self._preempt(victim, step)
            if victim is request:
                return None

    def _preempt(self, request: Request, step: _StepPlan) -> None:
        """Take a running request's blocks back; it waits and is recomputed later."""
        self.running.remove(request)
        step.unschedule(request)
        self.kv_cache_manager.free(request, num_computed_tokens=request.num_computed_tokens)
        request.block_ids = []
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        step.num_preempted += 1
        step.preempted_ids.add(request.request_id)
        self._enqueue_waiting(request)

    def _schedule_waiting(self, step: _StepPlan) -> None:
        """Admit waiting requests in queue order until one must wait (and count why)."""
        while self.waiting:
            request = self.waiting[0]
            if request.request_id in step.preempted_ids:
                break  # preempted for an arrival in this step: it waits a step at least
            if len(self.running) >= self.limits.max_num_seqs:
                step.num_waits_max_num_seqs += 1
                break
            if not step.budget:
                step.num_waits_budget += 1
                break
            cached_prefix = self.kv_cache_manager.find_cached_prefix(request)
            num_cached = len(cached_prefix) * self.kv_cache_manager.block_size
            num_new = self.num_tokens_to_schedule(
                request, request.num_tokens - num_cached, step.budget
            )
            if num_new == 0:
                step.num_waits_budget += 1
                break
            block_ids = self.kv_cache_manager.allocate_slots(request, num_new, cached_prefix)
            if block_ids is None:
                victims = self._victims_to_admit(request, num_new, cached_prefix, step)
                if not victims:
                    step.num_waits_no_blocks += 1
                    break
                for victim in victims:
                    self._preempt(victim, step)
                continue
            self.waiting.pop(0)
            self._admit(request, block_ids, num_cached, step)
            step.add(request, num_new)

    def _victims_to_admit(
        self, request: Request, num_new: int, cached_prefix: list, step: _StepPlan
    ) -> list[Request]:
        """The requests :meth:`should_preempt_for` names, up to enough blocks for ``request``.

        Empty when the policy names none, or when preempting every request it would name
        still leaves ``request`` short of blocks (preempting them would waste their work).
        """
        kv_cache = self.kv_cache_manager
        num_short = kv_cache.num_blocks_short(request, num_new, cached_prefix)
        candidates = [r for r in self.running if r.request_id not in step.admitted_ids]
        victims: list[Request] = []
        while (victim := self.should_preempt_for(request, candidates)) is not None:
            if not any(victim is candidate for candidate in candidates):
                raise RuntimeError(
                    f"{type(self).__name__}.should_preempt_for returned request "
                    f"{victim.request_id!r}, which is not one of the candidates it was given"
                )
            victims.append(victim)
            candidates = [r for r in candidates if r is not victim]
            if kv_cache.num_blocks_freed_by(victims, keep=cached_prefix) >= num_short:
                return victims
        return []

    def _admit(
        self, request: Request, block_ids: list[int], num_cached: int, step: _StepPlan
    ) -> None:
        is_resumed = request.status is RequestStatus.PREEMPTED
        request.status = RequestStatus.RUNNING
        request.block_ids = list(block_ids)
        request.num_computed_tokens = num_cached
        request.num_cached_tokens = max(request.num_cached_tokens, num_cached)
        self.kv_cache_manager.record_prefix_lookup(request.num_tokens, num_cached)
        self.running.append(request)
        step.admitted_ids.add(request.request_id)
        if is_resumed:
            step.cached_requests.append(
                CachedRequestData(request.request_id, block_ids, num_cached, is_resumed=True)
            )
        else:
            step.new_requests.append(
                NewRequestData(
                    request.request_id,
                    list(request.all_token_ids),
                    request.sampling_params,
                    block_ids,
                    num_cached,
                    request.num_prompt_tokens,
                    request.eos_token_id,
                )
            )

    # ---- update --------------------------------------------------------------------

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> EngineCoreOutputs:
        """Advance counters, append sampled tokens, finish and free stopped requests."""
        outputs: list[EngineCoreOutput] = []
        sampled = runner_output.sampled_token_ids
        logprobs = runner_output.logprobs
        for request_id, num_new in scheduler_output.num_scheduled_tokens.items():
            request = self.requests.get(request_id)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue
            request.num_computed_tokens += num_new
            new_token_ids = self._append_until_stop(request, sampled.get(request_id, []))
            if not new_token_ids and not request.is_finished:
                continue
            new_logprobs = logprobs.get(request_id) if logprobs else None
            outputs.append(
                EngineCoreOutput(
                    request_id,
                    new_token_ids,
                    request.status.finish_reason,
                    request.stop_reason,
                    request.num_cached_tokens,
                    new_logprobs[: len(new_token_ids)] if new_logprobs else None,
                )
            )
            if request.is_finished:
                self.running.remove(request)
                self._release(request)
        return EngineCoreOutputs(outputs)

    def _append_until_stop(self, request: Request, token_ids: list[int]) -> list[int]:
        appended = []
        for token_id in token_ids:
            request.append_output_token(token_id)
            appended.append(token_id)
            if check_stop(request, self.limits.max_model_len):
                break
        return appended


@dataclass
class _StepPlan:
    """The batch being assembled by one :meth:`Scheduler.schedule` call, and its tallies."""

    budget: int
    num_preempted: int = 0
    num_prefill_requests: int = 0
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_waits_no_blocks: int = 0
    num_waits_budget: int = 0
    num_waits_max_num_seqs: int = 0

    def __post_init__(self) -> None:
        self.num_scheduled_tokens: dict[str, int] = {}
        self.new_requests: list[NewRequestData] = []
        self.cached_requests: list[CachedRequestData] = []
        self.admitted_ids: set[str] = set()
        self.preempted_ids: set[str] = set()

    def add(self, request: Request, num_tokens: int) -> None:
        self.num_scheduled_tokens[request.request_id] = num_tokens
        self.budget -= num_tokens
        self._tally(request, num_tokens, +1)

    def unschedule(self, request: Request) -> None:
        """Drop a request scheduled earlier in this step (a policy preempted it)."""
        num_tokens = self.num_scheduled_tokens.pop(request.request_id, 0)
        self.budget += num_tokens
        if num_tokens:
            self._tally(request, num_tokens, -1)
        self.cached_requests = [
            c for c in self.cached_requests if c.request_id != request.request_id
        ]

    def _tally(self, request: Request, num_tokens: int, sign: int) -> None:
        # Read before the step runs (and, on unschedule, before preemption resets it).
        if request.num_computed_tokens < request.num_prompt_tokens:
            self.num_prefill_requests += sign
            self.num_prefill_tokens += sign * num_tokens
        else:
            self.num_decode_tokens += sign * num_tokens
