"""A request's ``timings``, as llama.cpp's server puts them in each completion (what its
web UI and the tools written for it read to show prompt and generation speeds), from the
milestones the engine already records (:class:`~vlite.core.outputs.RequestMetrics`).

Completions and chat both add them here: a whole response carries them at its top level; a
stream on its last event before ``[DONE]`` (the usage chunk when ``include_usage`` asks for
one, else the chunk that finishes the last sample), where llama.cpp puts them.
"""

from __future__ import annotations

from typing import Any

from vlite.core.outputs import RequestOutput
from vlite.server.protocol import Timings, UsageInfo


def request_timings(last: RequestOutput, total: UsageInfo) -> Timings | None:
    """The timings of a finished request (``None`` without metrics to read them from).

    ``total`` is the usage the response reports, so the counts agree with it (an echo with
    ``max_tokens: 0`` reports no generated token, though the engine made one).
    """
    metrics = last.metrics
    if metrics is None:
        return None
    # A preempted request, resumed, may find more than its prompt cached.
    cache_n = min(last.num_cached_tokens, total.prompt_tokens)
    prompt_n = total.prompt_tokens - cache_n
    predicted_n = total.completion_tokens
    # The samples of n > 1 share no last token time: the request's finish is theirs.
    last_token_time = metrics.last_token_time
    if last_token_time is None:
        last_token_time = metrics.finished_time
    prompt_ms = _ms_between(metrics.first_scheduled_time, metrics.first_token_time)
    predicted_ms = _ms_between(metrics.first_token_time, last_token_time)
    return Timings(
        cache_n=cache_n,
        prompt_n=prompt_n,
        prompt_ms=prompt_ms,
        prompt_per_token_ms=_ratio(prompt_ms, prompt_n),
        prompt_per_second=_per_second(prompt_n, prompt_ms),
        predicted_n=predicted_n,
        predicted_ms=predicted_ms,
        predicted_per_token_ms=_ratio(predicted_ms, predicted_n),
        predicted_per_second=_per_second(predicted_n, predicted_ms),
        queue_ms=_ms_between(metrics.arrival_time, metrics.first_scheduled_time),
    )


def with_timings(payload: dict[str, Any], last: RequestOutput, total: UsageInfo) -> dict:
    """``payload`` (a response or a chunk, as JSON) with the request's ``timings`` added."""
    timings = request_timings(last, total)
    if timings is not None:
        payload["timings"] = timings.model_dump()
    return payload


def _ms_between(start: float | None, end: float | None) -> float | None:
    """Milliseconds from ``start`` to ``end`` (``time.monotonic()`` values), never below 0:
    the scheduling time comes from the engine core's process, whose monotonic clock is this
    one's only on the same machine (an engine core of a Ray cluster elsewhere may disagree)."""
    if start is None or end is None:
        return None
    return max(0.0, (end - start) * 1000)


def _ratio(ms: float | None, count: int) -> float | None:
    return None if ms is None or count == 0 else ms / count


def _per_second(count: int, ms: float | None) -> float | None:
    return None if not ms else count * 1000 / ms
