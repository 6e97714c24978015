"""What completions and chat share: sampling options, running a request, SSE, disconnects."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request

from vlite.core.outputs import CompletionOutput, PositionLogprobs, RequestOutput, RequestOutputKind
from vlite.core.sampling_params import SAMPLING_PARAM_NAMES, SamplingParams
from vlite.engine.async_llm import AsyncLLM
from vlite.engine.input_processor import Prompt
from vlite.server.errors import OpenAIError, from_exception
from vlite.server.protocol import SamplingRequest, UsageInfo

T = TypeVar("T")

#: Request fields this server does not implement, and the values that mean "not asked for".
UNSUPPORTED_FIELDS: dict[str, tuple[Any, ...]] = {
    "best_of": (None, 1),
    "echo": (None, False),
    "suffix": (None, ""),
    "logit_bias": (None, {}),
    "tools": (None, []),
    "response_format": (None, {"type": "text"}),
}
# Request fields passed to SamplingParams as they are (the rest are set from the
# request's own fields: max_tokens, ignore_eos and the two shapes of logprobs).
_SAMPLING_FIELDS = tuple(
    name for name in SAMPLING_PARAM_NAMES if name not in ("max_tokens", "ignore_eos", "logprobs")
)

DONE = "data: [DONE]\n\n"


class ClientDisconnected(Exception):
    """The HTTP client went away before the response was ready."""


class OpenAIServing:
    """Base of the endpoints: the engine, the model's name, and the shared steps.

    Args:
        engine: the running AsyncLLM.
        served_model_name: the ``model`` that requests must name (if they name one).
    """

    def __init__(self, engine: AsyncLLM, served_model_name: str) -> None:
        self.engine = engine
        self.served_model_name = served_model_name

    def check_request(self, request: SamplingRequest) -> None:
        """Reject a request for another model or an unsupported feature."""
        if request.model is not None and request.model != self.served_model_name:
            raise OpenAIError(
                f"the model {request.model!r} does not exist; this server serves "
                f"{self.served_model_name!r}",
                status=404,
                param="model",
            )
        for name, unset_values in UNSUPPORTED_FIELDS.items():
            value = getattr(request, name)
            if not any(value == unset for unset in unset_values):
                raise OpenAIError(
                    f"{name}={value!r} is not supported by this server; leave it unset",
                    param=name,
                )

    def sampling_params(
        self, request: SamplingRequest, max_tokens: int, logprobs: int | None = None
    ) -> SamplingParams:
        """The request's SamplingParams; invalid values become a 400 naming the field."""
        given = {name: getattr(request, name) for name in _SAMPLING_FIELDS}
        options = {name: value for name, value in given.items() if value is not None}
        try:
            return SamplingParams(
                max_tokens=max_tokens, ignore_eos=request.ignore_eos, logprobs=logprobs, **options
            )
        except ValueError as exc:
            raise from_exception(exc) from None

    def default_max_tokens(self, num_prompt_tokens: int) -> int:
        """As many tokens as the context (and the KV cache) leave room for, at least 1."""
        info = self.engine.engine_info
        capacity = min(info.max_model_len, info.num_kv_blocks * info.block_size)
        return max(1, capacity - num_prompt_tokens)

    async def start(
        self, raw_request: Request, request_id: str, prompt: Prompt, params: SamplingParams
    ) -> tuple[RequestOutput, AsyncIterator[RequestOutput]]:
        """Send the request; return its first delta output and the stream of the rest.

        Waiting for the first output lets a request the core rejects (a prompt too long)
        still get a proper error status instead of an error inside a started stream.
        """
        stream = self.engine.generate(
            prompt, params, request_id, output_kind=RequestOutputKind.DELTA
        )
        try:
            first = await run_until_disconnected(raw_request, anext(stream))
        except Exception as exc:
            await stream.aclose()
            if isinstance(exc, ClientDisconnected):
                raise
            raise from_exception(exc) from exc
        return first, stream


@dataclass
class Choice:
    """One sample of a request, put together from its delta outputs."""

    index: int
    texts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    @property
    def text(self) -> str:
        return "".join(self.texts)

    def add(self, delta: CompletionOutput) -> None:
        self.texts.append(delta.text)
        self.token_ids += delta.token_ids
        self.logprobs += delta.logprobs or []
        self.finish_reason = delta.finish_reason
        self.stop_reason = delta.stop_reason


async def collect(
    raw_request: Request, first: RequestOutput, stream: AsyncIterator[RequestOutput], n: int
) -> tuple[list[Choice], RequestOutput]:
    """Run a started request to its end: ``(its n choices, the last output)``."""

    async def rest() -> tuple[list[Choice], RequestOutput]:
        choices = [Choice(index) for index in range(n)]
        output = first
        while True:
            for delta in output.outputs:
                choices[delta.index].add(delta)
            if output.finished:
                return choices, output
            output = await anext(stream)

    try:
        return await run_until_disconnected(raw_request, rest())
    except ClientDisconnected:
        raise
    except Exception as exc:
        raise from_exception(exc) from exc
    finally:
        await stream.aclose()


async def run_until_disconnected(raw_request: Request, awaitable: Awaitable[T]) -> T:
    """Await ``awaitable`` unless the client disconnects first (then it is cancelled,
    which aborts its request in the engine, and :class:`ClientDisconnected` is raised)."""
    task = asyncio.ensure_future(awaitable)
    watcher = asyncio.ensure_future(_wait_for_disconnect(raw_request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    if task.cancelled():
        raise ClientDisconnected()
    return task.result()


async def _wait_for_disconnect(raw_request: Request) -> None:
    while (await raw_request.receive())["type"] != "http.disconnect":
        pass


def usage(prompt_tokens: int, completion_tokens: int) -> UsageInfo:
    return UsageInfo(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
    )


def sse(payload: dict[str, Any] | str) -> str:
    """One server-sent event: ``data: {json}`` and a blank line."""
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"


def sse_error(exc: BaseException) -> str:
    """An error inside a started stream, as an event holding OpenAI's error body."""
    return sse(from_exception(exc).to_response().model_dump())
