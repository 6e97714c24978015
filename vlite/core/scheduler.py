"""The scheduling mechanism every scheduler policy shares.

:class:`Scheduler` owns the mechanism: the waiting queue and running list, the per-step
token budget and ``max_num_seqs``, block allocation with prefix-cache lookups, chunked
prefill (``SchedulerLimits.enable_chunked_prefill``, ``long_prefill_token_threshold``),
recompute preemption, and turning sampled tokens into finished requests. The policy (in
which order to admit, whom to preempt) is a
:class:`~vlite.core.scheduling_policy.SchedulingPolicy` that the mechanism asks and whose
answers it checks; :func:`build_scheduler` puts the two together.

Plugin API 1 had policies subclass :class:`Scheduler` and override the policy methods
(``waiting_sort_key``, ``choose_victim``, ``num_tokens_to_schedule``, ...); such a subclass
still works (its overrides answer instead of a policy object) and is deprecated.

Every ``schedule()`` also leaves a :class:`~vlite.core.stats.StepStats` in
``last_step_stats``: the batch's make-up and why requests were held back.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import time
import warnings
from dataclasses import dataclass

from vlite.core.errors import PluginError
from vlite.core.grammar_gate import GrammarGate, grammar_ends
from vlite.core.kv_cache import KVCacheManager
from vlite.core.outputs import (
    CachedRequestData,
    EngineCoreOutput,
    EngineCoreOutputs,
    GrammarBitmask,
    ModelRunnerOutput,
    NewRequestData,
    RequestFailure,
    SchedulerOutput,
)
from vlite.core.request import Request, RequestStatus
from vlite.core.scheduling_policy import SchedulingPolicy
from vlite.core.stats import StepStats
from vlite.core.step_cost import StepCostModel
from vlite.core.stop import check_stop
from vlite.core.structured_output_manager import StructuredOutputManager

#: The last date on which a vlite release serves API-1 ``Scheduler`` subclasses.
API_1_SCHEDULERS_END = "2027-06-30"

#: Prompt tokens a step beside decodes may always take under ``max_itl_ms`` (one KV block
#: of 16), so that prompts progress even where the decodes alone exceed the target (holding
#: prompts back until the decodes drain left steps of one or two streams, and cost more).
MIN_PROMPT_TOKENS_BESIDE_DECODES = 16
#: Under ``max_itl_ms`` a step beside decodes may always last this many times its decodes'
#: own measured time, whatever the target: where the decodes alone come near the target (a
#: larger model, a slower host), prompts still prefill in chunks that use the step well. (On
#: the default model's batch of 8, 24 ms, the 60 ms target is exactly 2.5 times; chunks of
#: 16 tokens there cost twice a 128-token chunk's time per token.)
MIN_STEP_OVER_DECODES = 2.5


@dataclass(frozen=True)
class SchedulerLimits:
    """The limits and mechanism settings a scheduler applies every step.

    Attributes:
        max_num_seqs: most requests in one step's batch.
        max_num_batched_tokens: the step's token budget.
        max_model_len: longest context (prompt plus generated tokens).
        enable_chunked_prefill: whether a prompt may be computed over several steps (part
            of it when the budget has room for part); without it a prompt runs whole or
            waits. ``None`` (only before :func:`build_scheduler`): the policy's default.
        long_prefill_token_threshold: with chunked prefill, the most tokens one request
            computes in a step (0: no limit but the budget), so that several prompts share
            a step.
        recompute_past_length: the model's cached keys depend on whether their sequence
            knows more than this many tokens (LongRoPE's pre-training context, see
            :attr:`~vlite.core.model.ModelDescription.recompute_past_length`): a request
            whose cache was started at or below it is computed again from position 0 once
            it knows more, scheduled within the token budget like a prompt. ``None``: never.
        max_batches_in_flight: batches the engine keeps in flight (1: the plain step;
            a pipeline's stages, or async scheduling): with more, a batch takes an equal
            share of the active requests so that a pipeline's batches are alike.
        overlaps_decodes: whether a request whose batch in flight samples its next token
            may be scheduled in the next batch to compute that token, before the host knows
            it (async scheduling on one stage, whose workers run batches in order and know
            the tokens they sampled). A request that turns out to have stopped wastes that
            one token, which nothing reads.
        num_lookahead_tokens: the most slots a request may hold past its scheduled tokens,
            where a draft model writes its drafts (``Request.num_worker_drafts``); admission
            counts them.
        speculative: speculative decoding is on: a request that may speculate is never
            scheduled while a batch of its own is in flight (with ``overlaps_decodes``), so
            its drafts always follow tokens the engine knows.
        max_itl_ms: with chunked prefill, a target for the wall time of a step that carries
            decodes (each running stream's gap between tokens): such a step takes only as
            many prompt tokens as the steps run so far say fit in it
            (:class:`~vlite.core.step_cost.StepCostModel`; at least
            :data:`MIN_PROMPT_TOKENS_BESIDE_DECODES`, and at least what fits in
            :data:`MIN_STEP_OVER_DECODES` times the decodes' time); a step without decodes
            takes the whole budget. Steps are measured where the engine runs one batch at a
            time (with a batch queue none is, and nothing is capped). ``None``: no target.
    """

    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    enable_chunked_prefill: bool | None = False
    long_prefill_token_threshold: int = 0
    recompute_past_length: int | None = None
    max_batches_in_flight: int = 1
    overlaps_decodes: bool = False
    num_lookahead_tokens: int = 0
    speculative: bool = False
    max_itl_ms: float | None = None


def build_scheduler(
    scheduler_cls: type,
    limits: SchedulerLimits,
    kv_cache_manager: KVCacheManager,
    structured_outputs: StructuredOutputManager | None = None,
) -> Scheduler:
    """The scheduler for a registered class: the mechanism asking a policy (plugin API 2),
    or an API-1 :class:`Scheduler` subclass (deprecated). ``limits`` as
    :func:`resolve_limits` leaves them; ``structured_outputs`` compiles the grammars of
    requests that have one."""
    limits = resolve_limits(scheduler_cls, limits)
    if issubclass(scheduler_cls, Scheduler):
        warnings.warn(
            f"scheduler {_qualified_name(scheduler_cls)} subclasses "
            "vlite.core.scheduler.Scheduler (plugin API 1); register a "
            "vlite.core.scheduling_policy.SchedulingPolicy subclass instead (plugin API 2); "
            f"plugin API 1 is served until {API_1_SCHEDULERS_END}, and not after",
            DeprecationWarning,
            stacklevel=2,
        )
        # An API-1 subclass's constructor takes (limits, kv_cache_manager) only.
        scheduler = scheduler_cls(limits, kv_cache_manager)
        scheduler.grammars.manager = structured_outputs
        return scheduler
    return Scheduler(limits, kv_cache_manager, scheduler_cls(), structured_outputs)


def resolve_limits(scheduler_cls: type, limits: SchedulerLimits) -> SchedulerLimits:
    """``limits`` with ``enable_chunked_prefill=None`` replaced by the class's default
    (:attr:`SchedulingPolicy.default_enable_chunked_prefill`, or an API-1 subclass's
    ``supports_chunked_prefill``)."""
    if limits.enable_chunked_prefill is not None:
        return limits
    if issubclass(scheduler_cls, Scheduler):
        chunks = scheduler_cls.supports_chunked_prefill
    else:
        chunks = getattr(scheduler_cls, "default_enable_chunked_prefill", False)
    return dataclasses.replace(limits, enable_chunked_prefill=bool(chunks))


class _SubclassDefaults(SchedulingPolicy):
    """The optional answers for an API-1 :class:`Scheduler` subclass, which overrides the
    required ones itself."""

    def waiting_sort_key(self, request: Request) -> tuple:
        raise NotImplementedError("an API-1 Scheduler subclass must define waiting_sort_key")

    def choose_victim(self, running: list[Request]) -> Request:
        raise NotImplementedError("an API-1 Scheduler subclass must define choose_victim")


class Scheduler:
    """The shared mechanism; it asks ``policy`` the policy questions and checks the answers.

    Args:
        limits: per-step limits and the chunked-prefill setting (resolved to a bool).
        kv_cache_manager: the block manager of the engine's KV cache.
        policy: the plugin's :class:`~vlite.core.scheduling_policy.SchedulingPolicy`;
            ``None`` only for an API-1 subclass, which answers through its own overrides.
        structured_outputs: compiles the grammars of requests that have one (``None``:
            such a request fails when it is scheduled).
    """

    #: API 1 only: whether the subclass chunks prompts when the config does not say.
    supports_chunked_prefill = False
    #: Whether admission may reuse prefix-cached blocks (an API-1 subclass may say no; the
    #: engine then refuses ``enable_prefix_caching=True``).
    supports_prefix_caching = True

    def __init__(
        self,
        limits: SchedulerLimits,
        kv_cache_manager: KVCacheManager,
        policy: SchedulingPolicy | None = None,
        structured_outputs: StructuredOutputManager | None = None,
    ) -> None:
        self.limits = resolve_limits(type(self), limits)
        self.kv_cache_manager = kv_cache_manager
        self.policy: SchedulingPolicy = policy if policy is not None else _SubclassDefaults()
        #: Who answers the policy questions, for error messages.
        self.policy_name = _qualified_name(type(self) if policy is None else type(policy))
        self.requests: dict[str, Request] = {}
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        #: Request id -> tokens scheduled for it in batches not yet through
        #: :meth:`update_from_output` (a batch queue keeps several in flight). Such a
        #: request is not preempted until its batches come back, nor scheduled again,
        #: except as a decode overlap (:attr:`overlaps_decodes`).
        self.in_flight: dict[str, int] = {}
        #: Holds structured-output requests until their grammar compiles; their masks.
        self.grammars = GrammarGate(structured_outputs)
        self._failures: list[RequestFailure] = []
        self._arrival_counter = itertools.count()
        self._finished_since_last_step: list[str] = []
        self.num_preemptions = 0
        #: Requests that gave back blocks of rejected drafts -> the blocks they kept (told
        #: to the worker with their next step).
        self._num_kept_blocks: dict[str, int] = {}
        #: Speculative decoding: draft tokens verified, and how many of them were kept.
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        #: The last update's accepted drafts per position: ``[i]`` counts the requests
        #: whose draft ``i`` (from 0) was kept.
        self.last_accepted_per_position: list[int] = []
        self.num_steps = 0
        self.last_step_stats: StepStats | None = None
        #: What steps cost, learnt from :meth:`observe_step` (``max_itl_ms`` only).
        self.step_cost = StepCostModel() if self.limits.max_itl_ms else None

    @property
    def max_batches_in_flight(self) -> int:
        """Batches the engine keeps in flight (:attr:`SchedulerLimits.max_batches_in_flight`)."""
        return self.limits.max_batches_in_flight

    @property
    def overlaps_decodes(self) -> bool:
        """:attr:`SchedulerLimits.overlaps_decodes`."""
        return self.limits.overlaps_decodes

    def forget_batches_in_flight(self) -> None:
        """The batches in flight will never come back (one failed, and those behind it ran
        on a state it left unknown): their requests may be scheduled again."""
        self.in_flight.clear()

    def _batch_seq_cap(self) -> int:
        """Most requests one batch takes: all of them, or with ``max_batches_in_flight``
        batches in flight an equal share of the active requests (running and waiting, up
        to ``max_num_seqs``), so a pipeline's batches are alike and its stages stay busy."""
        if self.max_batches_in_flight == 1 or self.overlaps_decodes:
            return 1 << 62
        active = min(self.limits.max_num_seqs, len(self.running) + len(self.waiting))
        return max(1, -(-active // self.max_batches_in_flight))

    @property
    def chunks_prefills(self) -> bool:
        """Whether prompts may be computed over several steps."""
        return bool(self.limits.enable_chunked_prefill)

    # ---- the policy questions (API-1 subclasses override these) ----------------------

    def waiting_sort_key(self, request: Request) -> tuple:
        """Sort key of a waiting request: the smallest is admitted first."""
        return self.policy.waiting_sort_key(request)

    def choose_victim(self, running: list[Request]) -> Request:
        """The running request to preempt when a step runs out of blocks."""
        return self.policy.choose_victim(running)

    def running_order(self, running: list[Request]) -> list[Request]:
        """The order in which running requests claim the budget (a new list)."""
        return self.policy.running_order(running)

    def should_preempt_for(self, request: Request, running: list[Request]) -> Request | None:
        """The running request to preempt so that waiting ``request`` can be admitted."""
        return self.policy.should_preempt_for(request, running)

    def num_tokens_to_schedule(self, request: Request, num_pending: int, budget: int) -> int:
        """How many of ``num_pending`` tokens to compute this step with ``budget`` left.

        Without chunked prefill: all of them or none. With it: as many as the budget, the
        policy's :meth:`~SchedulingPolicy.max_chunk_tokens` (or
        ``long_prefill_token_threshold``) allow.
        """
        if not self.chunks_prefills:
            return num_pending if num_pending <= budget else 0
        limit = self.policy.max_chunk_tokens(request)
        if limit is None:
            limit = self.limits.long_prefill_token_threshold or num_pending
        elif not isinstance(limit, int) or limit < 1:
            raise self._policy_error(f"max_chunk_tokens returned {limit!r} (allowed: int >= 1)")
        return min(num_pending, budget, limit)

    def observe_step(self, stats: StepStats, seconds: float) -> None:
        """Take a finished step's wall time (the engine calls this after each step whose
        batch it ran alone), for ``max_itl_ms``."""
        if self.step_cost is not None:
            self.step_cost.observe(stats.num_decode_tokens, stats.num_prefill_tokens, seconds)

    def _budget_for(self, request: Request, step: _StepPlan) -> int:
        """The budget ``request`` may draw on: the step's, and for a prompt in a step that
        carries decodes under ``max_itl_ms``, what is left of the prompt tokens that fit
        the target."""
        target = self.limits.max_itl_ms
        decoding = request.num_computed_tokens >= request.num_prompt_tokens
        if not target or decoding or not step.num_decode_tokens or not self.chunks_prefills:
            return step.budget
        if step.prompt_token_cap is None:
            assert self.step_cost is not None  # made with the target
            decode_seconds = self.step_cost.decode_seconds(step.num_decode_tokens) or 0.0
            seconds = max(target / 1000, MIN_STEP_OVER_DECODES * decode_seconds)
            within = self.step_cost.prompt_tokens_within(seconds, step.num_decode_tokens)
            step.prompt_token_cap = (
                step.budget + step.num_prefill_tokens  # not measured yet: no cap
                if within is None
                else max(within, MIN_PROMPT_TOKENS_BESIDE_DECODES)
            )
        return max(min(step.budget, step.prompt_token_cap - step.num_prefill_tokens), 0)

    def arrival_index(self, request: Request) -> int:
        """``request.arrival_index`` (kept for API-1 subclasses)."""
        return request.arrival_index

    # ---- checked answers -----------------------------------------------------------

    def _policy_error(self, problem: str) -> PluginError:
        return PluginError(f"scheduler policy {self.policy_name}: {problem}")

    def _checked_running_order(self) -> list[Request]:
        order = self.running_order(self.running)
        if len(order) != len(self.running) or {id(r) for r in order} != {
            id(r) for r in self.running
        }:
            raise self._policy_error(
                "running_order must return the running requests, each once, in any order; "
                f"got {[r.request_id for r in order]} for {[r.request_id for r in self.running]}"
            )
        if self.chunks_prefills:  # decodes first: a prompt chunk never stalls a stream
            order.sort(key=lambda r: r.num_computed_tokens < r.num_prompt_tokens)
        return order

    def _checked_victim(self) -> Request | None:
        """The policy's victim among the running requests not in a batch in flight
        (``None``: every running request is)."""
        candidates = self._preemptable()
        if not candidates:
            return None
        victim = self.choose_victim(candidates)
        if not any(victim is request for request in candidates):
            name = getattr(victim, "request_id", victim)
            raise self._policy_error(
                f"choose_victim returned {name!r}, which is not one of the running requests "
                f"{[r.request_id for r in candidates]}"
            )
        return victim

    def _preemptable(self) -> list[Request]:
        """Running requests whose blocks no batch in flight is using."""
        if not self.in_flight:
            return self.running
        return [r for r in self.running if r.request_id not in self.in_flight]

    def has_schedulable_requests(self) -> bool:
        """Whether :meth:`schedule` could pick anything: a waiting request, or a running
        one not in a batch in flight (or overlapping one)."""
        return bool(self.waiting) or any(
            r.request_id not in self.in_flight or self._continues_in_flight(r) for r in self.running
        )

    def _continues_in_flight(self, request: Request) -> bool:
        """Whether a request in a batch in flight may be scheduled for the token that batch
        samples (see :attr:`overlaps_decodes`): that batch computes the last of its known
        tokens, the sampled token cannot be its last by length, and no grammar needs to see
        the token before the next mask."""
        if not self.overlaps_decodes or request.structured_output is not None:
            return False
        if self.limits.speculative and request.can_speculate:
            return False  # its next drafts follow the token that batch samples
        if request.num_computed_tokens + self.in_flight[request.request_id] != request.num_tokens:
            return False
        return (
            request.num_output_tokens + 1 < request.sampling_params.max_tokens
            and request.num_tokens + 1 < self.limits.max_model_len
            and not self._outgrows_cache(request, request.num_tokens + 1)
        )

    def _outgrows_cache(self, request: Request, num_tokens: int) -> bool:
        """Whether ``request``, knowing ``num_tokens`` tokens, must compute its cache again
        from position 0 (see :attr:`SchedulerLimits.recompute_past_length`)."""
        limit = self.limits.recompute_past_length
        return limit is not None and request.num_tokens_at_cache_start <= limit < num_tokens

    def _restart_cache(self, request: Request) -> None:
        """Compute ``request``'s cache again from position 0, in the blocks it holds."""
        request.num_computed_tokens = 0
        request.num_tokens_at_cache_start = request.num_tokens

    def _checked_num_tokens(self, request: Request, num_pending: int, budget: int) -> int:
        num_new = self.num_tokens_to_schedule(request, num_pending, budget)
        if not isinstance(num_new, int) or not 0 <= num_new <= min(num_pending, budget):
            raise self._policy_error(
                f"num_tokens_to_schedule returned {num_new!r} for request "
                f"{request.request_id!r} (allowed: 0..{min(num_pending, budget)})"
            )
        return num_new

    # ---- requests in and out -------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a request; one with structured outputs waits for its grammar first."""
        self.requests[request.request_id] = request
        request.arrival_index = next(self._arrival_counter)
        if request.sampling_params.structured_outputs is None:
            self._enqueue_waiting(request)
        else:
            self.grammars.hold(request)

    def admit_compiled_requests(self) -> None:
        """Move the requests whose grammar has compiled to the waiting queue; end those
        whose grammar failed (reported by the next :meth:`update_from_output` or
        :meth:`take_failures`)."""
        ready, failed = self.grammars.release()
        for request in ready:
            self._enqueue_waiting(request)
        for request, reason in failed:
            self._failures.append(RequestFailure(request.request_id, reason))
            self._release(request)

    @property
    def structured_outputs(self) -> StructuredOutputManager | None:
        """The grammar manager (the gate's; given at construction, settable for code that
        built the scheduler without one)."""
        return self.grammars.manager

    @structured_outputs.setter
    def structured_outputs(self, manager: StructuredOutputManager | None) -> None:
        self.grammars.manager = manager

    @property
    def waiting_for_fsm(self) -> list[Request]:
        """Requests whose grammar is compiling (``WAITING_FOR_FSM``), in arrival order."""
        return self.grammars.compiling

    @property
    def has_failures(self) -> bool:
        return bool(self._failures)

    def take_failures(self) -> list[RequestFailure]:
        """The requests ended since the last call because they could not go on."""
        failures, self._failures = self._failures, []
        return failures

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
            elif request.status is RequestStatus.WAITING_FOR_FSM:
                self.grammars.drop(request)
            else:
                self.waiting.remove(request)
            request.status = status
            self._release(request)

    def _release(self, request: Request) -> None:
        # Blocks allocated for a step that never completed (a failed step, then an abort)
        # were published to the prefix cache but never written: free them as uncomputed.
        self.kv_cache_manager.free(request, num_computed_tokens=request.num_computed_tokens)
        del self.requests[request.request_id]
        self._num_kept_blocks.pop(request.request_id, None)
        self._finished_since_last_step.append(request.request_id)
        self.grammars.forget(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.requests)

    @property
    def num_waiting_requests(self) -> int:
        """Requests not running: queued, or waiting for their grammar to compile."""
        return len(self.waiting) + len(self.grammars.compiling)

    # ---- schedule ------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Choose this step's batch: running requests first, then admissions."""
        self.admit_compiled_requests()
        step = _StepPlan(self.limits.max_num_batched_tokens, self._batch_seq_cap())
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
            num_waiting_requests=self.num_waiting_requests,
            num_kv_blocks_used=kv.num_used_blocks,
            num_kv_blocks_free=kv.num_free_blocks,
            num_prefix_cache_queried_tokens=kv.num_prefix_queried_tokens - num_queried,
            num_prefix_cache_hit_tokens=kv.num_prefix_hit_tokens - num_hit,
            num_preemptions=step.num_preempted,
            num_new_prompt_tokens=sum(new.num_prompt_tokens for new in step.new_requests),
            num_waits_no_blocks=step.num_waits_no_blocks,
            num_waits_budget=step.num_waits_budget,
            num_waits_max_num_seqs=step.num_waits_max_num_seqs,
            num_drafts=len(step.spec_token_ids),
            num_draft_tokens=sum(map(len, step.spec_token_ids.values())),
        )
        self.num_steps += 1
        for request_id, num_tokens in step.num_scheduled_tokens.items():
            self.in_flight[request_id] = self.in_flight.get(request_id, 0) + num_tokens
        return SchedulerOutput(
            new_requests=step.new_requests,
            cached_requests=step.cached_requests,
            num_scheduled_tokens=step.num_scheduled_tokens,
            finished_request_ids=finished,
            num_preempted=step.num_preempted,
            grammar_bitmask=self._grammar_bitmask(step) if self.grammars.num_structured else None,
            spec_token_ids=step.spec_token_ids,
            num_lookahead_tokens=step.num_lookahead_tokens,
        )

    def _grammar_bitmask(self, step: _StepPlan) -> GrammarBitmask | None:
        """One row per structured request that samples this step (its scheduled tokens
        reach the end of its known tokens: a decode, or a prompt's last chunk)."""
        rows = []
        for request_id, num_new in step.num_scheduled_tokens.items():
            request = self.requests[request_id]
            grammar = request.structured_output
            if grammar is not None and request.num_computed_tokens + num_new >= request.num_tokens:
                rows.append((request_id, grammar))
        return self.grammars.bitmask(rows, step.spec_token_ids)

    def _schedule_running(self, step: _StepPlan) -> None:
        is_budget_spent = False
        for request in self._checked_running_order():
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            num_in_flight = self.in_flight.get(request.request_id, 0)
            if num_in_flight and not self._continues_in_flight(request):
                continue  # its previous batch has not come back yet
            if len(step.num_scheduled_tokens) >= step.max_seqs:
                break  # the batch's share of the requests is full
            if not num_in_flight and self._outgrows_cache(request, request.num_tokens):
                self._restart_cache(request)
            # An overlapping request computes the one token its batch in flight samples.
            num_pending = 1 if num_in_flight else request.num_tokens - request.num_computed_tokens
            num_new = self._checked_num_tokens(
                request, num_pending, self._budget_for(request, step)
            )
            if num_new == 0:
                is_budget_spent = True
                continue
            drafts = request.spec_token_ids
            request.spec_token_ids = []
            if drafts and num_new == num_pending == 1 and not num_in_flight:
                drafts = drafts[: step.budget - 1]  # within the budget, the drafts after it
                num_new += len(drafts)
            else:
                drafts = []
            lookahead = self._num_lookahead(request, num_new, num_pending, num_in_flight)
            new_block_ids = self._allocate_or_preempt(
                request, num_new, step, num_in_flight, lookahead
            )
            if new_block_ids is None:
                continue
            step.cached_requests.append(
                CachedRequestData(
                    request.request_id,
                    new_block_ids,
                    request.num_computed_tokens + num_in_flight,
                    # The worker sampled an overlapping request's token itself.
                    new_token_ids=[] if num_in_flight else _tokens_to_compute(request, num_new),
                    num_kept_blocks=self._num_kept_blocks.pop(request.request_id, None),
                )
            )
            step.add(request, num_new)
            if drafts:
                step.spec_token_ids[request.request_id] = drafts
            if lookahead:
                step.num_lookahead_tokens[request.request_id] = lookahead
        step.num_waits_budget += is_budget_spent

    def _num_lookahead(
        self, request: Request, num_new: int, num_pending: int, num_in_flight: int
    ) -> int:
        """The drafts the workers make for a decoding request after this step (its
        ``num_worker_drafts``), as many as fit ``max_model_len``: the step yields up to
        ``num_new`` tokens, and each draft but the last is written to the cache."""
        if not request.num_worker_drafts or num_pending != 1 or num_in_flight:
            return 0
        room = self.limits.max_model_len - request.num_computed_tokens - num_new
        return max(min(request.num_worker_drafts, room), 0)

    def _allocate_or_preempt(
        self,
        request: Request,
        num_new: int,
        step: _StepPlan,
        num_in_flight: int = 0,
        num_lookahead: int = 0,
    ) -> list[int] | None:
        """Blocks for ``num_new`` tokens after the request's computed and in-flight ones
        (and ``num_lookahead`` slots after them, where a draft model writes its drafts),
        preempting the policy's victims while they are short (``None``: it waits)."""
        while True:
            new_block_ids = self.kv_cache_manager.allocate_slots(
                request, num_in_flight + num_new + num_lookahead
            )
            if new_block_ids is not None:
                return new_block_ids
            victim = self._checked_victim()
            if victim is None:
                return None  # every other request is in flight: this one waits a step
            self._preempt(victim, step)
            if victim is request:
                return None

    def _preempt(self, request: Request, step: _StepPlan) -> None:
        """Take a running request's blocks back; it waits and is recomputed later."""
        self.running.remove(request)
        step.unschedule(request)
        self.kv_cache_manager.free(request, num_computed_tokens=request.num_computed_tokens)
        self._num_kept_blocks.pop(request.request_id, None)  # its table is sent anew
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        # Its drafts follow its last token; its recompute samples one more.
        request.spec_token_ids = []
        request.num_worker_drafts = 0
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
            if (
                len(self.running) >= self.limits.max_num_seqs
                or len(step.num_scheduled_tokens) >= step.max_seqs
            ):
                step.num_waits_max_num_seqs += 1
                break
            if not step.budget:
                step.num_waits_budget += 1
                break
            cached_prefix = (
                self.kv_cache_manager.find_cached_prefix(request)
                if request.sampling_params.prompt_logprobs is None
                else []  # a cached prefix has no logits to take the prompt's logprobs from
            )
            num_cached = len(cached_prefix) * self.kv_cache_manager.block_size
            num_new = self._checked_num_tokens(
                request, request.num_tokens - num_cached, self._budget_for(request, step)
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
            self._admit(request, block_ids, num_cached, num_new, step)
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
        candidates = [r for r in self._preemptable() if r.request_id not in step.admitted_ids]
        victims: list[Request] = []
        while (victim := self.should_preempt_for(request, candidates)) is not None:
            if not any(victim is candidate for candidate in candidates):
                name = getattr(victim, "request_id", victim)
                raise self._policy_error(
                    f"should_preempt_for returned {name!r}, which is not one of the "
                    f"candidates it was given {[r.request_id for r in candidates]}"
                )
            victims.append(victim)
            candidates = [r for r in candidates if r is not victim]
            if kv_cache.num_blocks_freed_by(victims, keep=cached_prefix) >= num_short:
                return victims
        return []

    def _admit(
        self,
        request: Request,
        block_ids: list[int],
        num_cached: int,
        num_new: int,
        step: _StepPlan,
    ) -> None:
        is_resumed = request.status is RequestStatus.PREEMPTED
        if request.first_scheduled_time is None:
            request.first_scheduled_time = time.monotonic()
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = num_cached
        if not num_cached:
            request.num_tokens_at_cache_start = request.num_tokens
        request.num_cached_tokens = max(request.num_cached_tokens, num_cached)
        self.kv_cache_manager.record_prefix_lookup(request.num_tokens, num_cached)
        self.running.append(request)
        step.admitted_ids.add(request.request_id)
        if is_resumed:
            step.cached_requests.append(
                CachedRequestData(
                    request.request_id,
                    block_ids,
                    num_cached,
                    is_resumed=True,
                    new_token_ids=_tokens_to_compute(request, num_new),
                )
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
        self.last_accepted_per_position = []
        for request_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
            num_left = self.in_flight.pop(request_id, 0) - num_tokens
            if num_left > 0:
                self.in_flight[request_id] = num_left
        outputs: list[EngineCoreOutput] = []
        sampled = runner_output.sampled_token_ids
        logprobs = runner_output.logprobs
        for request_id, num_new in scheduler_output.num_scheduled_tokens.items():
            request = self.requests.get(request_id)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue
            if request_id in runner_output.prompt_logprobs:
                request.add_prompt_logprobs(runner_output.prompt_logprobs[request_id])
            tokens = sampled.get(request_id, [])
            drafts = scheduler_output.spec_token_ids.get(request_id)
            request.num_computed_tokens += num_new
            if drafts:  # the rejected drafts' slots hold nothing: computed up to the last kept
                self._count_verified(request, drafts, tokens)
                request.num_computed_tokens -= len(drafts) + 1 - len(tokens)
            new_token_ids = self._append_until_stop(request, tokens)
            if drafts and not request.is_finished:
                self._give_back_rejected_blocks(request)
            if request.status is RequestStatus.FINISHED_ERROR:
                self._failures.append(RequestFailure(request_id, request.error, False))
                self.running.remove(request)
                self._release(request)
                continue
            if not new_token_ids and not request.is_finished:
                continue
            new_logprobs = logprobs.get(request_id) if logprobs else None
            output = (
                _final_output(request, new_token_ids, new_logprobs)
                if request.is_finished
                else EngineCoreOutput(
                    request_id,
                    new_token_ids,
                    num_cached_tokens=request.num_cached_tokens,
                    new_logprobs=new_logprobs[: len(new_token_ids)] if new_logprobs else None,
                    first_scheduled_time=_on_first_tokens(request, new_token_ids),
                )
            )
            output.prompt_logprobs = request.take_prompt_logprobs()
            outputs.append(output)
            if request.is_finished:
                self.running.remove(request)
                self._release(request)
        return EngineCoreOutputs(outputs, self.take_failures())

    def _give_back_rejected_blocks(self, request: Request) -> None:
        """Free the blocks that hold only rejected drafts; the worker hears of it with the
        request's next :class:`CachedRequestData`."""
        kv = self.kv_cache_manager
        num_held = len(kv.block_ids_of(request.request_id))
        kv.trim(request, request.num_tokens)
        num_kept = len(kv.block_ids_of(request.request_id))
        if num_kept < num_held:
            self._num_kept_blocks[request.request_id] = num_kept

    def _count_verified(self, request: Request, drafts: list[int], tokens: list[int]) -> None:
        """Tally a step that verified ``drafts`` and yielded ``tokens`` (the accepted drafts
        and one token of the model's own)."""
        if not 1 <= len(tokens) <= len(drafts) + 1 or tokens[:-1] != drafts[: len(tokens) - 1]:
            raise RuntimeError(
                f"request {request.request_id!r}: the worker returned {tokens} for drafts "
                f"{drafts} (expected the accepted drafts and one more token)"
            )
        self.num_draft_tokens += len(drafts)
        self.num_accepted_tokens += len(tokens) - 1
        per_position = self.last_accepted_per_position
        per_position += [0] * (len(tokens) - 1 - len(per_position))
        for position in range(len(tokens) - 1):
            per_position[position] += 1

    def _append_until_stop(self, request: Request, token_ids: list[int]) -> list[int]:
        appended = []
        for token_id in token_ids:
            request.append_output_token(token_id)
            appended.append(token_id)
            if request.structured_output is not None and grammar_ends(request, token_id):
                break
            if check_stop(request, self.limits.max_model_len):
                break
        return appended


def _final_output(
    request: Request, new_token_ids: list[int], new_logprobs: list | None = None
) -> EngineCoreOutput:
    """A finished request's last output (its finish reason, stop reason or error)."""
    return EngineCoreOutput(
        request.request_id,
        new_token_ids,
        request.status.finish_reason,
        request.stop_reason,
        request.num_cached_tokens,
        new_logprobs[: len(new_token_ids)] if new_logprobs else None,
        request.first_scheduled_time,
        request.shows_last_token,
    )


def _on_first_tokens(request: Request, new_token_ids: list[int]) -> float | None:
    """When the request was first scheduled, on the output that brings its first tokens
    (else ``None``): a request that a stop string ends in the front end gets no last output
    from here, yet its queue and prompt times need this."""
    if new_token_ids and request.num_output_tokens == len(new_token_ids):
        return request.first_scheduled_time
    return None


def _qualified_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _tokens_to_compute(request: Request, num_new: int) -> list[int]:
    """The ``num_new`` tokens a step computes for ``request``, from its first uncomputed."""
    start = request.num_computed_tokens
    return request.all_token_ids[start : start + num_new]


@dataclass
class _StepPlan:
    """The batch being assembled by one :meth:`Scheduler.schedule` call, and its tallies."""

    budget: int
    #: Most requests in this batch (a share of the active ones with a batch queue).
    max_seqs: int = 1 << 62
    num_preempted: int = 0
    num_prefill_requests: int = 0
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_waits_no_blocks: int = 0
    num_waits_budget: int = 0
    num_waits_max_num_seqs: int = 0
    #: Under ``max_itl_ms``: the prompt tokens this step may carry beside its decodes
    #: (set when the first prompt asks, once the decodes are scheduled).
    prompt_token_cap: int | None = None

    def __post_init__(self) -> None:
        self.num_scheduled_tokens: dict[str, int] = {}
        self.new_requests: list[NewRequestData] = []
        self.cached_requests: list[CachedRequestData] = []
        self.admitted_ids: set[str] = set()
        self.preempted_ids: set[str] = set()
        self.spec_token_ids: dict[str, list[int]] = {}
        self.num_lookahead_tokens: dict[str, int] = {}

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
        self.spec_token_ids.pop(request.request_id, None)
        self.num_lookahead_tokens.pop(request.request_id, None)

    def _tally(self, request: Request, num_tokens: int, sign: int) -> None:
        # Read before the step runs (and, on unschedule, before preemption resets it).
        if request.num_computed_tokens < request.num_prompt_tokens:
            self.num_prefill_requests += sign
            self.num_prefill_tokens += sign * num_tokens
        else:
            self.num_decode_tokens += sign * num_tokens
