"""EngineCore: the heartbeat. Owns the scheduler and the executor; ``step()`` runs one batch."""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass

from vlite.core.config import VliteConfig
from vlite.core.draft_source import DraftSource, StepTiming
from vlite.core.errors import InvalidRequestError
from vlite.core.executor import Executor
from vlite.core.kv_cache import KVCacheManager
from vlite.core.memory import MemoryPlan
from vlite.core.model import ModelDescription
from vlite.core.outputs import EngineCoreOutputs, ModelRunnerOutput, SchedulerOutput
from vlite.core.plugins import PluginRegistry, build_plugin_manager
from vlite.core.proposer import may_speculate
from vlite.core.request import EngineCoreRequest, Request, RequestStatus
from vlite.core.sampler import unsupported_sampling_options
from vlite.core.scheduler import Scheduler, build_scheduler
from vlite.core.stats import (
    BatchEntry,
    CoreOccupancy,
    StepObserver,
    StepRecord,
    StepStats,
    StepTotals,
)
from vlite.core.structured_output_manager import StructuredOutputManager
from vlite.core.verify import verify_config

#: How long a step with nothing to run but requests whose grammar compiles waits for one.
GRAMMAR_WAIT_S = 0.01


def kv_cache_window(windows: tuple[int | None, ...]) -> int | None:
    """The window the KV-cache manager may free blocks by: the largest, when every layer
    has one (a block is dropped only once no layer can see it); else ``None``."""
    if not windows or any(window is None for window in windows):
        return None
    return max(windows)


@dataclass
class _BatchInFlight:
    """A batch submitted to the executor, waiting for its output."""

    scheduler_output: SchedulerOutput
    output: Future[ModelRunnerOutput]
    stats: StepStats
    record: StepRecord | None


def batch_queue_depth(config: VliteConfig, executor: Executor) -> int:
    """How many batches the engine keeps in flight: one per pipeline stage, and two on a
    single stage with ``async_scheduling`` (the next batch is scheduled while one runs)."""
    depth = executor.max_concurrent_batches
    if depth == 1 and config.resolved_async_scheduling:
        return 2
    return depth


class EngineCore:
    """Schedules, executes and samples, one step at a time.

    Args:
        config: the engine configuration.
        model_spec: the resolved model (``vlite.models.spec.ModelSpec.from_config``), passed
            in by the engine above so that the core imports no model code.
        registry: plugin classes to draw from; by default a fresh plugin manager's.
    """

    def __init__(
        self,
        config: VliteConfig,
        model_spec: ModelDescription,
        registry: PluginRegistry | None = None,
    ) -> None:
        self.registry = registry or PluginRegistry(build_plugin_manager())
        self.model_spec = model_spec
        #: What the configuration phase resolved (every refusal is raised there, before
        #: the executor exists).
        self.verified = verified = verify_config(config, model_spec, self.registry)
        #: The configuration in use: ``attention_backend`` resolved, prefix caching off
        #: where the model conflicts with it.
        self.config = config = verified.config
        self.sampler_cls = verified.plugins["sampler"]
        #: Which weights stay quantized (``config.quantization`` for this model and device).
        self.quantization = verified.quantization
        #: The attention backend in use (what ``auto`` resolved to).
        self.attention_backend_name = verified.attention_backend
        self.executor: Executor = verified.plugins["executor"](config, self.registry)
        try:
            num_blocks = self.executor.initialize_kv_cache()
        except BaseException:
            self.executor.shutdown()
            raise
        windows = tuple(model_spec.sliding_windows)
        self.kv_cache_manager = KVCacheManager(
            num_blocks, config.block_size, config.enable_prefix_caching, kv_cache_window(windows)
        )
        #: What the weights and the KV cache hold over every worker (``None``: the executor
        #: does not report its workers' memory).
        worker_memory = getattr(self.executor, "worker_memory", ())
        self.memory_plan: MemoryPlan | None = (
            MemoryPlan.from_workers(worker_memory, num_blocks, config.block_size)
            if worker_memory
            else None
        )
        #: Batches kept in flight at most (1: the plain four-stage step).
        self.max_batches_in_flight = batch_queue_depth(config, self.executor)
        limits = dataclasses.replace(
            verified.limits,
            max_batches_in_flight=self.max_batches_in_flight,
            # Async scheduling on one stage: the next batch goes on with the same decodes.
            overlaps_decodes=(
                self.max_batches_in_flight > 1 and self.executor.max_concurrent_batches == 1
            ),
        )
        self.structured_outputs = self._build_structured_outputs(config, model_spec)
        self.scheduler: Scheduler = build_scheduler(
            verified.plugins["scheduler"], limits, self.kv_cache_manager, self.structured_outputs
        )
        #: Speculative decoding's draft source (``None``: no speculation).
        self.drafts: DraftSource | None = None
        #: Whether every registered logits processor edits rows after drafts as it should
        #: (then requests with ``extra_args`` speculate too).
        self.processors_follow_drafts = all(
            getattr(entry.obj, "follows_drafts", False)
            for entry in self.registry.entries()
            if entry.kind == "logits_processor"
        )
        if config.speculative_config is not None:
            proposer = verified.plugins["proposer"](config.speculative_config)
            self.drafts = DraftSource(proposer, config.speculative_config, self.scheduler)
        self._step_observers: list[StepObserver] = []
        #: Sums over every step run so far (what ``/metrics`` counts).
        self.step_totals = StepTotals()
        self._batch_queue: deque[_BatchInFlight] = deque()

    def _build_structured_outputs(
        self, config: VliteConfig, model_spec: ModelDescription
    ) -> StructuredOutputManager:
        kind = "structured_output_backend"
        backends = {name: self.registry.get(kind, name) for name in self.registry.names(kind)}
        return StructuredOutputManager(
            backends,
            config.structured_outputs_backend,
            model_spec.load_tokenizer,
            model_spec.vocab_size,
            config.grammar_compile_timeout_s,
        )

    # ---- requests ------------------------------------------------------------------

    def add_request(self, core_request: EngineCoreRequest) -> None:
        """Queue a request; raises :class:`~vlite.core.errors.InvalidRequestError` if it
        could never be scheduled, or asks for a sampling option the configured sampler does
        not support."""
        self._check_fits(core_request)
        self._check_sampling(core_request)
        structured = core_request.sampling_params.structured_outputs
        if structured is not None:
            self.structured_outputs.check(core_request.request_id, structured)
        if core_request.request_id in self.scheduler.requests:
            raise InvalidRequestError(f"request_id {core_request.request_id!r} is already in use")
        request = Request(core_request)
        request.can_speculate = may_speculate(
            core_request.sampling_params, self.processors_follow_drafts
        )
        self.scheduler.add_request(request)

    def _check_fits(self, core_request: EngineCoreRequest) -> None:
        limits = self.scheduler.limits
        num_prompt = len(core_request.prompt_token_ids)
        if num_prompt == 0:
            raise InvalidRequestError(f"request {core_request.request_id!r} has an empty prompt")
        if num_prompt >= limits.max_model_len:
            raise InvalidRequestError(
                f"request {core_request.request_id!r}: prompt of {num_prompt} tokens does not "
                f"leave room to generate within max_model_len={limits.max_model_len}"
            )
        if num_prompt > limits.max_num_batched_tokens and not self.scheduler.chunks_prefills:
            raise InvalidRequestError(
                f"request {core_request.request_id!r}: prompt of {num_prompt} tokens exceeds "
                f"max_num_batched_tokens={limits.max_num_batched_tokens} and chunked prefill "
                "is off (enable_chunked_prefill=True, --enable-chunked-prefill, splits it)"
            )
        max_total = min(
            num_prompt + core_request.sampling_params.max_tokens + limits.num_lookahead_tokens,
            limits.max_model_len,
        )
        step_tokens = limits.max_num_batched_tokens if self.scheduler.chunks_prefills else None
        num_blocks = self.kv_cache_manager.max_blocks_held(max_total, step_tokens)
        if num_blocks > self.kv_cache_manager.num_blocks:
            raise InvalidRequestError(
                f"request {core_request.request_id!r} may need {num_blocks} KV-cache blocks "
                f"but the cache has {self.kv_cache_manager.num_blocks} of "
                f"{self.kv_cache_manager.block_size} tokens; lower max_tokens, or raise "
                "num_kv_blocks (or kv_cache_tokens and kv_cache_memory_gib, which bound the "
                "cache's default size)"
            )

    def _check_sampling(self, core_request: EngineCoreRequest) -> None:
        params = core_request.sampling_params
        if params.n != 1:
            raise InvalidRequestError(
                f"request {core_request.request_id!r} has n={params.n}: the engine core runs "
                "one sample per request (LLM and AsyncLLM fan n > 1 out into n requests)"
            )
        unsupported = unsupported_sampling_options(self.sampler_cls, params)
        if unsupported:
            raise InvalidRequestError(
                f"request {core_request.request_id!r} uses {', '.join(unsupported)}, which the "
                f"sampler {self.config.sampler!r} does not support (it does not claim "
                "the capability); use the 'default' sampler"
            )

    def abort_requests(self, request_ids: list[str]) -> None:
        """Finish requests as aborted and free their blocks. Unknown ids are ignored."""
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def finish_requests(self, request_ids: list[str], status: RequestStatus) -> None:
        """Finish requests for a reason found outside the core (a stop string)."""
        self.scheduler.finish_requests(request_ids, status)

    def fail_unfinished_requests(self) -> list[str]:
        """Finish every unfinished request as an error, freeing its blocks (after a step
        that raised: its batch is in an unknown state); return their ids."""
        request_ids = list(self.scheduler.requests)
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ERROR)
        return request_ids

    def has_unfinished_requests(self) -> bool:
        """Whether a step has work: requests, batches in flight, or failures to report."""
        scheduler = self.scheduler
        return (
            scheduler.has_unfinished_requests() or bool(self._batch_queue) or scheduler.has_failures
        )

    # ---- statistics ----------------------------------------------------------------

    def occupancy(self) -> CoreOccupancy:
        """The KV blocks and requests the core holds now."""
        kv_cache, scheduler = self.kv_cache_manager, self.scheduler
        return CoreOccupancy(
            num_kv_blocks=kv_cache.num_blocks,
            num_free_kv_blocks=kv_cache.num_free_blocks,
            num_unfinished_requests=scheduler.num_unfinished_requests,
            num_running_requests=len(scheduler.running),
            num_waiting_requests=scheduler.num_waiting_requests,
        )

    @property
    def last_step_stats(self) -> StepStats | None:
        """The statistics of the latest step (``None`` before the first)."""
        return self.scheduler.last_step_stats

    def add_step_observer(self, observer: StepObserver) -> None:
        """Call ``observer(StepRecord)`` after every step (e.g. a ``TraceWriter``).

        Without observers a step gathers nothing beyond ``last_step_stats``.
        """
        self._step_observers.append(observer)

    def remove_step_observer(self, observer: StepObserver) -> None:
        self._step_observers.remove(observer)

    # ---- the step ------------------------------------------------------------------

    def step(self) -> EngineCoreOutputs:
        """One iteration: schedule -> execute_model -> sample_tokens -> update_from_output.

        With several batches in flight (a pipeline, or async scheduling) the same stages
        run through a queue: :meth:`step_with_batch_queue`.
        """
        if self.max_batches_in_flight > 1:
            return self.step_with_batch_queue()
        self.scheduler.admit_compiled_requests()
        if not self.scheduler.has_schedulable_requests():
            return self._wait_for_grammars()  # (nothing at all: no outputs, at once)
        started = time.perf_counter()
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.is_empty and not scheduler_output.num_preempted:
            raise RuntimeError(
                f"the scheduler could schedule none of {self.scheduler.num_unfinished_requests} "
                "unfinished requests (a prompt larger than the token budget or the KV cache?)"
            )
        record = self._start_record(scheduler_output) if self._step_observers else None
        self.executor.execute_model(scheduler_output)
        model_runner_output = self.executor.sample_tokens()
        outputs = self.scheduler.update_from_output(scheduler_output, model_runner_output)
        seconds = time.perf_counter() - started
        accepted = self.scheduler.last_accepted_per_position
        if self.scheduler.last_step_stats is not None:
            self.scheduler.observe_step(self.scheduler.last_step_stats, seconds)
        if self.drafts is not None:
            stats = self.scheduler.last_step_stats
            timing = StepTiming(
                seconds,
                bool(scheduler_output.spec_token_ids),
                stats is not None and stats.num_prefill_tokens == 0,
                bool(scheduler_output.num_lookahead_tokens),
                stats.num_decode_tokens if stats is not None else 0,
            )
            self.drafts.propose(
                outputs,
                timing,
                model_runner_output.draft_token_ids,
                scheduler_output.spec_token_ids,
            )
        self.step_totals.add(self.scheduler.last_step_stats, outputs, accepted)
        if record is not None:
            record = dataclasses.replace(record, accepted_per_position=tuple(accepted))
            for observer in self._step_observers:
                observer(record)
        return outputs

    def step_with_batch_queue(self) -> EngineCoreOutputs:
        """Keep up to :attr:`max_batches_in_flight` batches in flight, then finish the oldest.

        Schedule and submit while there is room and something to schedule (a request is in
        one batch in flight at most: the scheduler skips and never preempts those), then
        wait for the oldest batch and run ``update_from_output`` on it: batches are
        updated in the order they were scheduled.
        """
        self.scheduler.admit_compiled_requests()
        while (
            len(self._batch_queue) < self.max_batches_in_flight
            and self.scheduler.has_schedulable_requests()
        ):
            scheduler_output = self.scheduler.schedule()
            news = scheduler_output.num_preempted or scheduler_output.finished_request_ids
            if scheduler_output.is_empty and not news:
                break  # nothing fits until a batch in flight comes back
            record = self._start_record(scheduler_output) if self._step_observers else None
            stats = self.scheduler.last_step_stats
            future = self.executor.execute_model_async(scheduler_output)
            self._batch_queue.append(_BatchInFlight(scheduler_output, future, stats, record))
        if not self._batch_queue:
            if self.scheduler.waiting_for_fsm or self.scheduler.has_failures:
                return self._wait_for_grammars()
            if self.scheduler.has_unfinished_requests():
                raise RuntimeError(
                    "the scheduler could schedule none of "
                    f"{self.scheduler.num_unfinished_requests} unfinished requests and no "
                    "batch is in flight (a prompt larger than the token budget or the KV cache?)"
                )
            return EngineCoreOutputs()
        batch = self._batch_queue.popleft()
        try:
            runner_output = batch.output.result()
        except BaseException:
            # The batches behind it ran on a state this one left unknown: drop them all.
            self._batch_queue.clear()
            self.scheduler.forget_batches_in_flight()
            raise
        outputs = self.scheduler.update_from_output(batch.scheduler_output, runner_output)
        accepted = self.scheduler.last_accepted_per_position
        if self.drafts is not None:  # (batches overlap: no step time for the governor)
            self.drafts.propose(
                outputs,
                None,
                runner_output.draft_token_ids,
                batch.scheduler_output.spec_token_ids,
            )
        self.step_totals.add(batch.stats, outputs, accepted)
        if batch.record is not None:
            record = dataclasses.replace(batch.record, accepted_per_position=tuple(accepted))
            for observer in self._step_observers:
                observer(record)
        return outputs

    def _wait_for_grammars(self) -> EngineCoreOutputs:
        """Nothing can run but requests whose grammar compiles: wait a moment for one (the
        caller's loop goes on), and report the requests whose grammar failed."""
        scheduler = self.scheduler
        if not scheduler.has_failures:
            grammars = [request.structured_output for request in scheduler.waiting_for_fsm]
            self.structured_outputs.wait_for_any(grammars, GRAMMAR_WAIT_S)
            scheduler.admit_compiled_requests()
        return EngineCoreOutputs(failures=scheduler.take_failures())

    def _start_record(self, scheduler_output) -> StepRecord:
        """The batch as scheduled (counters before the step) and the requests held."""
        requests = self.scheduler.requests
        batch = []
        for request_id, num_new in scheduler_output.num_scheduled_tokens.items():
            request = requests[request_id]
            num_computed = request.num_computed_tokens
            is_prefill = num_computed < request.num_prompt_tokens
            batch.append(BatchEntry(request_id, num_new, num_computed, is_prefill))
        stats = self.scheduler.last_step_stats
        return StepRecord(stats, batch, list(requests.values()))

    def shutdown(self) -> None:
        self.structured_outputs.shutdown()
        self.executor.shutdown()
