"""OutputProcessor: turns EngineCoreOutputs into RequestOutputs (text, stop strings)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from vlite.core.outputs import (
    CompletionOutput,
    EngineCoreOutput,
    RequestMetrics,
    RequestOutput,
    RequestOutputKind,
)
from vlite.core.request import EngineCoreRequest, RequestStatus
from vlite.engine.detokenizer import IncrementalDetokenizer


@dataclass
class _RequestState:
    request: EngineCoreRequest
    prompt: str | None
    detokenizer: IncrementalDetokenizer
    metrics: RequestMetrics
    token_ids: list[int]
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    num_cached_tokens: int = 0
    # What earlier DELTA outputs already carried.
    num_sent_chars: int = 0
    num_sent_tokens: int = 0


@dataclass
class ProcessedOutputs:
    """One step's results: outputs for the caller, and requests to stop in the core."""

    request_outputs: list[RequestOutput]
    request_ids_to_stop: list[str]


class OutputProcessor:
    """Front-end state of every live request: detokenizer, tokens so far, timings."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._states: dict[str, _RequestState] = {}

    def add_request(
        self,
        request: EngineCoreRequest,
        prompt: str | None,
        output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE,
    ) -> None:
        """Track a request sent to the core; ``output_kind`` shapes its RequestOutputs."""
        if request.request_id in self._states:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        detokenizer = IncrementalDetokenizer(
            self.tokenizer, request.prompt_token_ids, request.sampling_params.stop
        )
        metrics = RequestMetrics(arrival_time=request.arrival_time)
        self._states[request.request_id] = _RequestState(
            request, prompt, detokenizer, metrics, [], output_kind
        )

    def abort_requests(self, request_ids: list[str]) -> list[RequestOutput]:
        """Forget requests; return a final ``finish_reason="abort"`` output for each known one."""
        outputs = []
        for request_id in request_ids:
            state = self._states.pop(request_id, None)
            if state is not None:
                state.metrics.finished_time = time.monotonic()
                outputs.append(_make_request_output(state, "abort", None))
        return outputs

    def has_unfinished_requests(self) -> bool:
        return bool(self._states)

    def process_outputs(
        self, outputs: list[EngineCoreOutput], emit_unfinished: bool = True
    ) -> ProcessedOutputs:
        """Detokenize new tokens; a stop string finishes the request here (and in the core).

        With ``emit_unfinished=False`` only finished requests get a RequestOutput (the
        offline path, which has no use for partial results); so do ``FINAL_ONLY`` requests.
        """
        now = time.monotonic()
        request_outputs: list[RequestOutput] = []
        to_stop: list[str] = []
        for output in outputs:
            state = self._states.get(output.request_id)
            if state is None:
                continue  # aborted by the caller since the step began
            finish_reason, stop_reason = output.finish_reason, output.stop_reason
            if state.metrics.first_token_time is None and output.new_token_ids:
                state.metrics.first_token_time = now
            state.token_ids += output.new_token_ids
            state.num_cached_tokens = output.num_cached_tokens
            if state.detokenizer.add_tokens(_tokens_to_detokenize(output)):
                if finish_reason is None:
                    to_stop.append(output.request_id)
                finish_reason = RequestStatus.FINISHED_STOPPED.finish_reason
                stop_reason = state.detokenizer.stop_string
            if finish_reason is not None:
                state.metrics.finished_time = now
                del self._states[output.request_id]
            if finish_reason is not None or (
                emit_unfinished and state.output_kind is not RequestOutputKind.FINAL_ONLY
            ):
                request_outputs.append(_make_request_output(state, finish_reason, stop_reason))
        return ProcessedOutputs(request_outputs, to_stop)


def _tokens_to_detokenize(output: EngineCoreOutput) -> list[int]:
    """The new tokens whose text is shown: a stopping token (EOS or a stop token id) is not."""
    if output.finish_reason == RequestStatus.FINISHED_STOPPED.finish_reason:
        return output.new_token_ids[:-1]
    return output.new_token_ids


def _make_request_output(
    state: _RequestState, finish_reason: str | None, stop_reason: int | str | None
) -> RequestOutput:
    """The request's output now: cumulative, or (``DELTA``) only what is new.

    An unfinished request shows only its stable text: the tail that a stop string could
    still claim is held back, so streamed text never has to be taken back.
    """
    is_finished = finish_reason is not None
    detokenizer = state.detokenizer
    text = detokenizer.text if is_finished else detokenizer.text[: detokenizer.num_stable_chars]
    token_ids = state.token_ids
    if state.output_kind is RequestOutputKind.DELTA:
        text, token_ids = text[state.num_sent_chars :], token_ids[state.num_sent_tokens :]
        state.num_sent_chars += len(text)
        state.num_sent_tokens += len(token_ids)
    completion = CompletionOutput(
        index=0,
        text=text,
        token_ids=list(token_ids),
        finish_reason=finish_reason,
        stop_reason=stop_reason,
    )
    return RequestOutput(
        request_id=state.request.request_id,
        prompt=state.prompt,
        prompt_token_ids=state.request.prompt_token_ids,  # shared, not copied every step
        outputs=[completion],
        finished=is_finished,
        num_cached_tokens=state.num_cached_tokens,
        metrics=state.metrics,
    )
