"""A request's identity on the wire (EngineCoreRequest) and its live state (Request)."""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

import msgspec

from vlite.core.outputs import PromptLogprobs, SampledLogprobs
from vlite.core.proposer import may_speculate
from vlite.core.sampling_params import SamplingParams

if TYPE_CHECKING:
    from vlite.core.structured_output_manager import StructuredOutputRequest


class RequestStatus(enum.Enum):
    """Where a request is in its life.

    ``WAITING -> RUNNING -> FINISHED_*``; a running request whose blocks are taken back
    goes ``RUNNING -> PREEMPTED`` and is re-admitted (and its tokens recomputed) later. A
    request with structured outputs starts in ``WAITING_FOR_FSM`` while its grammar
    compiles, then goes on to ``WAITING`` (or ``FINISHED_ERROR`` if it cannot compile).
    """

    WAITING_FOR_FSM = "waiting_for_fsm"
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH_CAPPED = "finished_length_capped"
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_ERROR = "finished_error"

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        """vLLM's ``finish_reason`` string, or ``None`` while the request is unfinished."""
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}
_FINISHED = frozenset(_FINISH_REASONS)


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True):
    """What the front end sends the engine core: serializable, no live state."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None = None
    arrival_time: float = 0.0
    priority: int = 0


class Request:
    """A request's live state inside the engine core.

    The two counters that drive scheduling:

    * ``num_tokens``: prompt tokens plus tokens generated so far.
    * ``num_computed_tokens``: tokens whose K/V are in the cache. The scheduler computes
      ``num_tokens - num_computed_tokens`` new tokens for it on its next step.

    ``arrival_index`` numbers requests 0, 1, 2, ... in the order the scheduler received
    them (set by ``Scheduler.add_request``). The fields a scheduling policy may read are
    listed in :mod:`vlite.core.scheduling_policy`.
    """

    def __init__(self, core_request: EngineCoreRequest) -> None:
        self.request_id = core_request.request_id
        self.prompt_token_ids = list(core_request.prompt_token_ids)
        self.sampling_params = core_request.sampling_params
        self.eos_token_id = core_request.eos_token_id
        self.arrival_time = core_request.arrival_time
        self.priority = core_request.priority
        self.arrival_index = 0
        #: ``time.monotonic()`` when first admitted to the running batch (queue time).
        self.first_scheduled_time: float | None = None
        self.status = RequestStatus.WAITING
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        self.num_preemptions = 0
        #: Whether it may verify drafts (speculative decoding); the engine core decides on
        #: arrival, knowing its logits processors (:func:`~vlite.core.proposer.may_speculate`).
        self.can_speculate = may_speculate(self.sampling_params)
        #: Draft tokens a proposer guessed for after its last token (speculative decoding),
        #: verified in its next step.
        self.spec_token_ids: list[int] = []
        #: Drafts the workers make for it after its next step (a draft model's; the
        #: scheduler allocates their slots).
        self.num_worker_drafts = 0
        #: ``prompt_logprobs``: the entries of prompt positions 1, 2, ... computed so far,
        #: and whether they went out (with the request's first output).
        self.prompt_logprobs: list[SampledLogprobs] = []
        self.prompt_logprobs_sent = False
        #: Tokens the request knew when its cache was last computed from position 0 (see
        #: ``SchedulerLimits.recompute_past_length``).
        self.num_tokens_at_cache_start = 0
        self.stop_reason: int | str | None = None
        #: The grammar of a request with ``structured_outputs`` (set by the scheduler).
        self.structured_output: StructuredOutputRequest | None = None
        #: Why the core ended the request with ``FINISHED_ERROR``.
        self.error: str | None = None
        #: Stopped by its grammar on a token that belongs to the text.
        self.shows_last_token = False

    def add_prompt_logprobs(self, chunk: PromptLogprobs) -> None:
        """Take in a step's prompt logprobs; positions already known (a recompute after
        preemption computes them again) are skipped."""
        known = len(self.prompt_logprobs) + 1  # the next position wanted
        skip = known - chunk.first_position
        if skip < 0:
            raise RuntimeError(
                f"request {self.request_id!r}: prompt logprobs from position "
                f"{chunk.first_position}, but only up to {known - 1} are known"
            )
        self.prompt_logprobs += chunk.entries[skip:]

    def take_prompt_logprobs(self) -> list[SampledLogprobs] | None:
        """The prompt logprobs, the first time this is asked once there are any."""
        if self.prompt_logprobs_sent or self.sampling_params.prompt_logprobs is None:
            return None
        self.prompt_logprobs_sent = True
        return self.prompt_logprobs

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def max_tokens(self) -> int:
        return self.sampling_params.max_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.name}, "
            f"computed={self.num_computed_tokens}/{self.num_tokens})"
        )
