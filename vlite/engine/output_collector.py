"""RequestOutputCollector: the hand-off between the output handler and one generate() call."""

from __future__ import annotations

import asyncio

from vlite.core.outputs import RequestOutput, RequestOutputKind


class RequestOutputCollector:
    """Holds the newest output of one request until its consumer takes it.

    A consumer slower than the engine does not build a backlog: a new cumulative output
    replaces the one not yet taken, and a new delta is merged into it, so the consumer
    always gets everything in one piece. An error is raised to the consumer after any
    output that arrived before it.
    """

    def __init__(self, output_kind: RequestOutputKind) -> None:
        self.output_kind = output_kind
        self._output: RequestOutput | None = None
        self._error: BaseException | None = None
        self._ready = asyncio.Event()

    def put(self, output: RequestOutput) -> None:
        if self._output is None or self.output_kind is not RequestOutputKind.DELTA:
            self._output = output
        else:
            _merge_delta(self._output, output)
        self._ready.set()

    def put_error(self, error: BaseException) -> None:
        if self._error is None:
            self._error = error
        self._ready.set()

    async def get(self) -> RequestOutput:
        """The next output; raises the error put with :meth:`put_error` once outputs are out."""
        while self._output is None and self._error is None:
            self._ready.clear()
            await self._ready.wait()
        if self._output is not None:
            output, self._output = self._output, None
            return output
        raise self._error


def _merge_delta(pending: RequestOutput, newer: RequestOutput) -> None:
    """Append ``newer``'s delta to ``pending`` (neither has been handed to the consumer).

    Completions are matched by ``index`` (the samples of an ``n > 1`` request arrive one
    at a time); a sample new to ``pending`` is added in index order.
    """
    by_index = {completion.index: completion for completion in pending.outputs}
    for newer_completion in newer.outputs:
        completion = by_index.get(newer_completion.index)
        if completion is None:
            pending.outputs.append(newer_completion)
            continue
        completion.text += newer_completion.text
        completion.token_ids += newer_completion.token_ids
        completion.finish_reason = newer_completion.finish_reason
        completion.stop_reason = newer_completion.stop_reason
        completion.cumulative_logprob = newer_completion.cumulative_logprob
        if completion.logprobs is not None and newer_completion.logprobs is not None:
            completion.logprobs += newer_completion.logprobs
    pending.outputs.sort(key=lambda completion: completion.index)
    pending.finished = newer.finished
    pending.num_cached_tokens = newer.num_cached_tokens
    pending.metrics = newer.metrics
