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
    num_cached_tokens: int = 0


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

    def add_request(self, request: EngineCoreRequest, prompt: str | None) -> None:
        detokenizer = IncrementalDetokenizer(
            self.tokenizer, request.prompt_token_ids, request.sampling_params.stop
        )
        metrics = RequestMetrics(arrival_time=request.arrival_time)
        self._states[request.request_id] = _RequestState(request, prompt, detokenizer, metrics, [])

    def abort_requests(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self._states.pop(request_id, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self._states)

    def process_outputs(
        self, outputs: list[EngineCoreOutput], emit_unfinished: bool = True
    ) -> ProcessedOutputs:
        """Detokenize new tokens; a stop string finishes the request here (and in the core).

        With ``emit_unfinished=False`` only finished requests get a RequestOutput (the
        offline path, which has no use for partial results).
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
            if finish_reason is not None or emit_unfinished:
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
    completion = CompletionOutput(
        index=0,
        text=state.detokenizer.text,
        token_ids=list(state.token_ids),
        finish_reason=finish_reason,
        stop_reason=stop_reason,
    )
    return RequestOutput(
        request_id=state.request.request_id,
        prompt=state.prompt,
        prompt_token_ids=list(state.request.prompt_token_ids),
        outputs=[completion],
        finished=finish_reason is not None,
        num_cached_tokens=state.num_cached_tokens,
        metrics=state.metrics,
    )
