"""ParentRequest: one prompt with ``n > 1`` samples, run as ``n`` child requests.

The front end fans the request out (vLLM's ``ParentRequest``): the engine core only ever
sees one-sample requests, with ids ``"{index}_{parent_id}"`` and the same prompt (so the
prefix cache shares their blocks); with a seed, child ``i`` uses ``seed + i``. The
children's outputs are gathered back into one RequestOutput whose ``outputs`` hold a
CompletionOutput per sample, ordered by ``index``.
"""

from __future__ import annotations

import msgspec

from vlite.core.outputs import (
    CompletionOutput,
    PositionLogprobs,
    RequestMetrics,
    RequestOutput,
    RequestOutputKind,
)
from vlite.core.request import EngineCoreRequest


def child_request_id(parent_id: str, index: int) -> str:
    return f"{index}_{parent_id}"


class ParentRequest:
    """The state shared by the ``n`` children of one request.

    Args:
        request: the request as the caller made it (``sampling_params.n > 1``).
        prompt: the prompt's text, if known.
        output_kind: how the caller wants its outputs.
    """

    def __init__(
        self, request: EngineCoreRequest, prompt: str | None, output_kind: RequestOutputKind
    ) -> None:
        self.request = request
        self.prompt = prompt
        self.output_kind = output_kind
        self.num_samples = request.sampling_params.n
        self.metrics = RequestMetrics(arrival_time=request.arrival_time)
        #: The latest (cumulative) completion of each sample, once it has one.
        self.completions: list[CompletionOutput | None] = [None] * self.num_samples
        self.unfinished: set[int] = set(range(self.num_samples))
        self.num_cached_tokens = 0
        #: The prompt's logprobs (``prompt_logprobs``), from the first sample that has them.
        self.prompt_logprobs: list[PositionLogprobs | None] | None = None

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def is_finished(self) -> bool:
        return not self.unfinished

    @property
    def is_streaming(self) -> bool:
        return self.output_kind is not RequestOutputKind.FINAL_ONLY

    def child_requests(self) -> list[EngineCoreRequest]:
        """The ``n`` one-sample requests to send to the engine core."""
        params = self.request.sampling_params
        return [
            msgspec.structs.replace(
                self.request,
                request_id=child_request_id(self.request_id, index),
                sampling_params=params.for_sample(index),
            )
            for index in range(self.num_samples)
        ]

    def child_ids(self) -> list[str]:
        return [child_request_id(self.request_id, index) for index in range(self.num_samples)]

    def record(
        self, completion: CompletionOutput, child_metrics: RequestMetrics, num_cached_tokens: int
    ) -> None:
        """Take in a child's latest completion (cumulative, or a delta when streaming)."""
        if self.output_kind is not RequestOutputKind.DELTA:
            self.completions[completion.index] = completion
        if completion.finished:
            self.unfinished.discard(completion.index)
        metrics, child = self.metrics, child_metrics
        metrics.first_token_time = _earliest(metrics.first_token_time, child.first_token_time)
        if completion.finished:  # the sample's timings are complete
            metrics.first_scheduled_time = _earliest(
                metrics.first_scheduled_time, child.first_scheduled_time
            )
            metrics.inter_token_latencies += child.inter_token_latencies
            metrics.num_generation_tokens += child.num_generation_tokens
        if self.is_finished:
            metrics.finished_time = child.finished_time
        # Samples after the first usually hit the prefix cache the first one filled.
        self.num_cached_tokens = max(self.num_cached_tokens, num_cached_tokens)

    def make_output(self, updated: list[CompletionOutput]) -> RequestOutput:
        """The parent's output after children's updates (already :meth:`record`-ed).

        ``DELTA``: only the updated samples' deltas. Otherwise every sample's latest
        completion (a sample with none yet shows as empty), ordered by index.
        """
        if self.output_kind is RequestOutputKind.DELTA:
            completions = sorted(updated, key=lambda completion: completion.index)
        else:
            completions = [
                completion or CompletionOutput(index=index, text="", token_ids=[])
                for index, completion in enumerate(self.completions)
            ]
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.request.prompt_token_ids,
            outputs=completions,
            finished=self.is_finished,
            num_cached_tokens=self.num_cached_tokens,
            metrics=self.metrics,
            prompt_logprobs=self.prompt_logprobs,
        )


def _earliest(a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None else min(a, b)
