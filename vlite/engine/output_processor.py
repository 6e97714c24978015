"""OutputProcessor: turns EngineCoreOutputs into RequestOutputs (text, stop strings,
logprobs), and gathers the samples of ``n > 1`` requests back into one output."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from vlite.core.errors import InvalidRequestError
from vlite.core.outputs import (
    CompletionOutput,
    EngineCoreOutput,
    PositionLogprobs,
    RequestMetrics,
    RequestOutput,
    RequestOutputKind,
)
from vlite.core.request import EngineCoreRequest, RequestStatus
from vlite.engine.detokenizer import IncrementalDetokenizer
from vlite.engine.logprobs import LogprobsAccumulator, TokenTexts, prompt_position_logprobs
from vlite.engine.parent_request import ParentRequest


@dataclass
class _RequestState:
    """One request of the engine core: a caller's request, or one sample of a parent's."""

    request: EngineCoreRequest
    prompt: str | None
    detokenizer: IncrementalDetokenizer
    metrics: RequestMetrics
    token_ids: list[int]
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    num_cached_tokens: int = 0
    logprobs: LogprobsAccumulator | None = None
    parent: ParentRequest | None = None
    index: int = 0
    # What earlier DELTA outputs already carried.
    num_sent_chars: int = 0
    num_sent_tokens: int = 0
    #: ``prompt_logprobs``: the prompt's, once the core sent them.
    prompt_logprobs: list[PositionLogprobs | None] | None = None


@dataclass
class ProcessedOutputs:
    """One step's results: outputs for the caller, and requests to stop in the core."""

    request_outputs: list[RequestOutput]
    request_ids_to_stop: list[str]


class OutputProcessor:
    """Front-end state of every live request: detokenizer, tokens so far, timings.

    Callers use their own request ids; a request with ``n > 1`` samples is known to the
    engine core by its children's ids (:meth:`core_request_ids` maps one to the other).
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._token_texts = TokenTexts(tokenizer)
        self._states: dict[str, _RequestState] = {}
        self._parents: dict[str, ParentRequest] = {}

    def add_request(
        self,
        request: EngineCoreRequest,
        prompt: str | None,
        output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE,
    ) -> list[EngineCoreRequest]:
        """Track a request; ``output_kind`` shapes its RequestOutputs.

        Returns:
            What to send to the engine core: ``[request]``, or its ``n`` children when
            ``sampling_params.n > 1``.
        """
        request_id = request.request_id
        if request_id in self._states or request_id in self._parents:
            raise InvalidRequestError(f"request_id {request_id!r} is already in use")
        if request.sampling_params.n == 1:
            self._add_state(request, prompt, output_kind)
            return [request]
        parent = ParentRequest(request, prompt, output_kind)
        children = parent.child_requests()
        if any(child.request_id in self._states for child in children):
            raise InvalidRequestError(
                f"request_id {request_id!r} is already in use (by its samples)"
            )
        self._parents[request_id] = parent
        for index, child in enumerate(children):
            self._add_state(child, prompt, output_kind, parent, index)
        return children

    def _add_state(
        self,
        request: EngineCoreRequest,
        prompt: str | None,
        output_kind: RequestOutputKind,
        parent: ParentRequest | None = None,
        index: int = 0,
    ) -> None:
        params = request.sampling_params
        detokenizer = IncrementalDetokenizer(
            self.tokenizer, request.prompt_token_ids, params.stop, params.min_tokens
        )
        logprobs = None if params.logprobs is None else LogprobsAccumulator(self._token_texts)
        metrics = RequestMetrics(arrival_time=request.arrival_time)
        self._states[request.request_id] = _RequestState(
            request, prompt, detokenizer, metrics, [], output_kind, 0, logprobs, parent, index
        )

    def core_request_ids(self, request_ids: list[str]) -> list[str]:
        """The engine-core ids of callers' requests (a parent's are its children's)."""
        core_ids = []
        for request_id in request_ids:
            parent = self._parents.get(request_id)
            core_ids += parent.child_ids() if parent is not None else [request_id]
        return core_ids

    def caller_request_ids(self, core_request_ids: list[str]) -> list[str]:
        """The callers' ids of engine-core requests (a child's is its parent's), deduplicated."""
        caller_ids: dict[str, None] = {}
        for core_id in core_request_ids:
            state = self._states.get(core_id)
            parent = state.parent if state is not None else None
            caller_ids[parent.request_id if parent is not None else core_id] = None
        return list(caller_ids)

    def abort_requests(self, request_ids: list[str]) -> list[RequestOutput]:
        """Forget callers' requests; return a final ``finish_reason="abort"`` output for
        each known one (a parent's shows every unfinished sample as aborted)."""
        now = time.monotonic()
        outputs = []
        for request_id in request_ids:
            parent = self._parents.pop(request_id, None)
            if parent is not None:
                outputs.append(self._abort_parent(parent, now))
                continue
            state = self._states.pop(request_id, None)
            if state is not None:
                state.metrics.finished_time = now
                outputs.append(_make_request_output(state, "abort", None))
        return outputs

    def _abort_parent(self, parent: ParentRequest, now: float) -> RequestOutput:
        aborted = []
        for child_id in parent.child_ids():
            state = self._states.pop(child_id, None)
            if state is not None:
                state.metrics.finished_time = now
                completion = _make_completion(state, "abort", None)
                parent.record(completion, state.metrics, state.num_cached_tokens)
                aborted.append(completion)
        return parent.make_output(aborted)

    def has_unfinished_requests(self) -> bool:
        return bool(self._states)

    def process_outputs(
        self, outputs: list[EngineCoreOutput], emit_unfinished: bool = True
    ) -> ProcessedOutputs:
        """Detokenize new tokens; a stop string finishes the request here (and in the core).

        With ``emit_unfinished=False`` only finished requests get a RequestOutput (the
        offline path, which has no use for partial results); so do ``FINAL_ONLY`` requests.
        A parent's output carries all its samples once the last finishes; while streaming,
        every update of a sample gives one.
        """
        now = time.monotonic()
        request_outputs: list[RequestOutput] = []
        to_stop: list[str] = []
        for output in outputs:
            state = self._states.get(output.request_id)
            if state is None:
                continue  # aborted by the caller since the step began
            finish_reason, stop_reason = self._update(state, output, now)
            if finish_reason is not None and output.finish_reason is None:
                to_stop.append(output.request_id)  # a stop string, found here
            if finish_reason is not None:
                state.metrics.finished_time = now
                del self._states[output.request_id]
            is_wanted = emit_unfinished and state.output_kind is not RequestOutputKind.FINAL_ONLY
            if state.parent is not None:
                request_output = self._parent_output(state, finish_reason, stop_reason, is_wanted)
                if request_output is not None:
                    request_outputs.append(request_output)
            elif finish_reason is not None or is_wanted:
                request_outputs.append(_make_request_output(state, finish_reason, stop_reason))
        return ProcessedOutputs(request_outputs, to_stop)

    def _update(
        self, state: _RequestState, output: EngineCoreOutput, now: float
    ) -> tuple[str | None, int | str | None]:
        """Take in a step's news; return the finish and stop reasons (a stop string's too)."""
        finish_reason, stop_reason = output.finish_reason, output.stop_reason
        if output.new_token_ids:
            state.metrics.record_tokens(now, len(output.new_token_ids))
        if output.first_scheduled_time is not None:
            state.metrics.first_scheduled_time = output.first_scheduled_time
        state.token_ids += output.new_token_ids
        state.num_cached_tokens = output.num_cached_tokens
        if state.logprobs is not None and output.new_logprobs:
            state.logprobs.add(output.new_logprobs)
        if output.prompt_logprobs is not None:
            state.prompt_logprobs = prompt_position_logprobs(
                output.prompt_logprobs, self._token_texts
            )
            if state.parent is not None and state.parent.prompt_logprobs is None:
                state.parent.prompt_logprobs = state.prompt_logprobs
        if state.detokenizer.add_tokens(_tokens_to_detokenize(output)):
            finish_reason = RequestStatus.FINISHED_STOPPED.finish_reason
            stop_reason = state.detokenizer.stop_string
        return finish_reason, stop_reason

    def _parent_output(
        self,
        state: _RequestState,
        finish_reason: str | None,
        stop_reason: int | str | None,
        is_streaming: bool,
    ) -> RequestOutput | None:
        """The parent's output after one sample's update, if one is due."""
        parent = state.parent
        if finish_reason is None and not is_streaming:
            return None
        completion = _make_completion(state, finish_reason, stop_reason)
        parent.record(completion, state.metrics, state.num_cached_tokens)
        if parent.is_finished:
            del self._parents[parent.request_id]
        elif not is_streaming:
            return None
        return parent.make_output([completion])


def _tokens_to_detokenize(output: EngineCoreOutput) -> list[int]:
    """The new tokens whose text is shown: a stopping token (EOS or a stop token id) is not."""
    stopped = output.finish_reason == RequestStatus.FINISHED_STOPPED.finish_reason
    if stopped and not output.shows_last_token:
        return output.new_token_ids[:-1]
    return output.new_token_ids


def _make_completion(
    state: _RequestState, finish_reason: str | None, stop_reason: int | str | None
) -> CompletionOutput:
    """The request's completion now: cumulative, or (``DELTA``) only what is new.

    An unfinished request shows only its stable text: the tail that a stop string could
    still claim is held back, so streamed text never has to be taken back.
    """
    is_finished = finish_reason is not None
    detokenizer = state.detokenizer
    text = detokenizer.text if is_finished else detokenizer.text[: detokenizer.num_stable_chars]
    token_ids = state.token_ids
    logprobs = state.logprobs.logprobs if state.logprobs is not None else None
    if state.output_kind is RequestOutputKind.DELTA:
        start = state.num_sent_tokens
        text, token_ids = text[state.num_sent_chars :], token_ids[start:]
        logprobs = logprobs[start:] if logprobs is not None else None
        state.num_sent_chars += len(text)
        state.num_sent_tokens += len(token_ids)
    return CompletionOutput(
        index=state.index,
        text=text,
        token_ids=list(token_ids),
        finish_reason=finish_reason,
        stop_reason=stop_reason,
        cumulative_logprob=state.logprobs.cumulative_logprob if state.logprobs else None,
        logprobs=list(logprobs) if logprobs is not None else None,
    )


def _make_request_output(
    state: _RequestState, finish_reason: str | None, stop_reason: int | str | None
) -> RequestOutput:
    """The output of a request without samples: one completion."""
    return RequestOutput(
        request_id=state.request.request_id,
        prompt=state.prompt,
        prompt_token_ids=state.request.prompt_token_ids,  # shared, not copied every step
        outputs=[_make_completion(state, finish_reason, stop_reason)],
        finished=finish_reason is not None,
        num_cached_tokens=state.num_cached_tokens,
        metrics=state.metrics,
        prompt_logprobs=state.prompt_logprobs,
    )
