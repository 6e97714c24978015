"""What the endpoints share: the model's name and the prompt limits; for completions and
chat, sampling options, running a request, SSE, disconnects and the ``timings``."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel

from vlite.core.outputs import CompletionOutput, PositionLogprobs, RequestOutput, RequestOutputKind
from vlite.core.sampling_params import SAMPLING_PARAM_NAMES, SamplingParams
from vlite.core.structured_output_params import StructuredOutputsParams
from vlite.engine.async_llm import AsyncLLM
from vlite.engine.input_processor import Prompt
from vlite.server.errors import OpenAIError, from_exception, shorten
from vlite.server.output_constraints import logit_bias_of, request_constraint
from vlite.server.protocol import SamplingRequest, UsageInfo, random_id
from vlite.server.settings import ServerSettings
from vlite.server.timings import with_timings

T = TypeVar("T")

#: Request fields this server does not implement, and the values that mean "not asked for".
UNSUPPORTED_FIELDS: dict[str, tuple[Any, ...]] = {
    "best_of": (None, 1),
    "echo": (None, False),
    "suffix": (None, ""),
    "tools": (None, []),
}
# Request fields passed to SamplingParams as they are (the rest are set from the request's
# own fields: max_tokens, ignore_eos, the two shapes of logprobs, and the constraints of
# vlite.server.output_constraints; bad_words_token_ids and extra_args are not API fields).
_SAMPLING_FIELDS = tuple(
    name
    for name in SAMPLING_PARAM_NAMES
    if name
    not in (
        "max_tokens",
        "ignore_eos",
        "logprobs",
        "structured_outputs",
        "logit_bias",
        "bad_words_token_ids",
        "extra_args",
    )
)

DONE = "data: [DONE]\n\n"


class ClientDisconnected(Exception):
    """The HTTP client went away before the response was ready."""


class OpenAIServing:
    """Base of the endpoints: the engine, the model's name, and the shared skeleton.

    An endpoint checks its request and builds the prompt and the sampling parameters, then
    calls :meth:`serve`, which runs the request and answers with one JSON response or a
    stream of server-sent events. The endpoint supplies the shapes: :meth:`response` (the
    whole answer), :meth:`delta_events` (the events of one sample's new output),
    :meth:`usage_event`, and optionally :meth:`opening_events`.

    Args:
        engine: the running AsyncLLM.
        served_model_name: the ``model`` that requests must name (if they name one).
        settings: the server's limits (``max_n``, stop strings).
    """

    #: The prefix of the endpoint's response ids (``cmpl``, ``chatcmpl``).
    id_prefix = ""
    #: Request fields this endpoint does not implement (see :data:`UNSUPPORTED_FIELDS`).
    unsupported_fields = UNSUPPORTED_FIELDS
    #: The stream's last line: OpenAI's ``[DONE]`` (``None``: nothing after the events).
    stream_end: str | None = DONE

    def __init__(
        self, engine: AsyncLLM, served_model_name: str, settings: ServerSettings | None = None
    ) -> None:
        self.engine = engine
        self.served_model_name = served_model_name
        self.settings = settings or ServerSettings()
        #: Longer prompts cannot fit the context whatever their tokens: refused untokenized.
        self.max_prompt_chars = engine.max_model_len * longest_token_chars(engine.get_tokenizer())

    def check_request(self, request: SamplingRequest) -> None:
        """Reject a request for another model, an unsupported feature, or over a limit."""
        self.check_model(request.model)
        for name, unset_values in self.unsupported_fields.items():
            value = getattr(request, name)
            if not any(value == unset for unset in unset_values):
                raise OpenAIError(
                    f"{name}={shorten(value)} is not supported by this server; leave it unset",
                    param=name,
                )
        self._check_limits(request)

    def check_model(self, model: str | None) -> None:
        """Refuse (404, as OpenAI) a request that names a model this server does not serve."""
        if model is not None and model != self.served_model_name:
            raise OpenAIError(
                f"the model {shorten(model)} does not exist; this server serves "
                f"{self.served_model_name!r}",
                status=404,
                param="model",
            )

    def _check_limits(self, request: SamplingRequest) -> None:
        limits = self.settings
        if request.n > limits.max_n:
            raise OpenAIError(
                f"n={request.n} is over this server's limit of {limits.max_n} samples",
                param="n",
            )
        stops = [request.stop] if isinstance(request.stop, str) else request.stop or []
        if len(stops) > limits.max_stop_strings:
            raise OpenAIError(
                f"stop has {len(stops)} strings; this server allows at most "
                f"{limits.max_stop_strings}",
                param="stop",
            )
        for stop in stops:
            if len(stop) > limits.max_stop_string_chars:
                raise OpenAIError(
                    f"stop holds a string of {len(stop)} characters; this server allows at "
                    f"most {limits.max_stop_string_chars}",
                    param="stop",
                )

    def check_prompt_chars(self, num_chars: int, param: str) -> None:
        """Refuse, before tokenizing it, a prompt too long to fit the context."""
        if num_chars > self.max_prompt_chars:
            raise OpenAIError(
                f"the prompt has {num_chars} characters, more than can fit this model's "
                f"context of {self.engine.max_model_len} tokens (at most "
                f"{self.max_prompt_chars} characters)",
                param=param,
            )

    def check_length(self, num_prompt_tokens: int, max_tokens: int | None, param: str) -> None:
        """Refuse a request whose prompt, plus ``max_tokens`` if given, exceeds the context."""
        max_model_len = self.engine.max_model_len
        if num_prompt_tokens >= max_model_len:
            raise OpenAIError(
                f"this model's maximum context length is {max_model_len} tokens, and the "
                f"prompt has {num_prompt_tokens}: no room to generate",
                param=param,
            )
        if max_tokens is not None and num_prompt_tokens + max_tokens > max_model_len:
            raise OpenAIError(
                f"this model's maximum context length is {max_model_len} tokens; the request "
                f"asks for {num_prompt_tokens + max_tokens} ({num_prompt_tokens} in the "
                f"prompt, {max_tokens} in max_tokens): lower max_tokens to at most "
                f"{max_model_len - num_prompt_tokens}",
                param="max_tokens",
            )

    def sampling_params(
        self,
        request: SamplingRequest,
        max_tokens: int,
        logprobs: int | None = None,
        constraint: StructuredOutputsParams | None = None,
    ) -> SamplingParams:
        """The request's SamplingParams; invalid values become a 400 naming the field.

        ``constraint``: the endpoint's own output constraint (a chat request's forced tool
        call), which may not be combined with ``response_format``/``structured_outputs``.
        """
        given = {name: getattr(request, name) for name in _SAMPLING_FIELDS}
        options = {name: value for name, value in given.items() if value is not None}
        structured = request_constraint(request)
        if constraint is not None and structured is not None:
            raise OpenAIError(
                "a forced tool call (tool_choice) already constrains the output; leave "
                "response_format and structured_outputs unset",
                param="tool_choice",
            )
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                ignore_eos=request.ignore_eos,
                logprobs=logprobs,
                structured_outputs=constraint or structured,
                logit_bias=logit_bias_of(request),
                **options,
            )
        except ValueError as exc:
            raise from_exception(exc) from None

    def default_max_tokens(self, num_prompt_tokens: int) -> int:
        """As many tokens as the context (and the KV cache) leave room for, at least 1."""
        info = self.engine.engine_info
        capacity = min(info.max_model_len, info.num_kv_blocks * info.block_size)
        return max(1, capacity - num_prompt_tokens)

    # ---- the skeleton ------------------------------------------------------------------

    async def serve(
        self,
        request: SamplingRequest,
        raw_request: Request,
        prompt: Prompt,
        params: SamplingParams,
    ) -> Response:
        """Run the request; answer with the whole response, or stream it if asked."""
        request_id = self.new_request_id()
        try:
            first, stream = await self.start(raw_request, request_id, prompt, params)
            if request.stream:
                events = self._events(request_id, first, stream, request, params.n)
                return StreamingResponse(events, media_type="text/event-stream")
            choices, last = await collect(raw_request, first, stream, params.n)
        except ClientDisconnected:
            return Response(status_code=499)
        choices = self.final_choices(request, choices)
        num_generated = sum(len(choice.token_ids) for choice in choices)
        total = usage(len(last.prompt_token_ids), num_generated)
        response = self.response(request_id, request, choices, total, last)
        return JSONResponse(with_timings(response.model_dump(), last, total))

    async def _events(
        self,
        request_id: str,
        first: RequestOutput,
        stream: AsyncIterator[RequestOutput],
        request: SamplingRequest,
        n: int,
    ) -> AsyncIterator[str]:
        """SSE events: the opening ones, each output's deltas, usage (if asked), [DONE]; the
        last before [DONE] carries the ``timings``; an error after the stream started
        becomes an error event."""
        for payload in self.opening_events(request_id, n, first):
            yield self.frame(payload)
        output, num_tokens = first, 0
        state: dict[int, Any] = {}
        try:
            while True:
                payloads: list[dict[str, Any]] = []
                for completion in output.outputs:
                    num_tokens += len(completion.token_ids)
                    payloads += self.delta_events(request_id, request, completion, state)
                if output.finished:
                    break
                for payload in payloads:
                    yield self.frame(payload)
                output = await anext(stream)
            for payload in self._closing_events(request_id, request, output, num_tokens, payloads):
                yield self.frame(payload)
        except Exception as exc:
            yield self.error_event(exc)
        finally:
            await stream.aclose()
        if self.stream_end is not None:
            yield self.stream_end

    def _closing_events(
        self,
        request_id: str,
        request: SamplingRequest,
        last: RequestOutput,
        num_tokens: int,
        payloads: list[dict[str, Any]],
    ) -> list[dict[str, Any]]:
        """The last output's ``payloads`` and the usage chunk (if asked); the very last of
        them carries the ``timings``, where llama.cpp's stream has them."""
        total = usage(len(last.prompt_token_ids), num_tokens)
        if request.include_usage:
            payloads = [*payloads, self.usage_event(request_id, total)]
        if payloads:
            with_timings(payloads[-1], last, total)
        return payloads

    # ---- the shapes (endpoints override) -------------------------------------------

    def final_choices(self, request: Any, choices: list[Choice]) -> list[Choice]:
        """The samples as the (non-streamed) response shows them. Default: as generated."""
        return choices

    def response(
        self,
        request_id: str,
        request: Any,
        choices: list[Choice],
        total: UsageInfo,
        last: RequestOutput,
    ) -> BaseModel:
        """The whole (non-streamed) response; ``last``: the request's last output (its
        prompt, and the prompt's logprobs if asked)."""
        raise NotImplementedError

    def new_request_id(self) -> str:
        """A fresh response id, ``{id_prefix}-{32 hex digits}`` unless overridden."""
        return random_id(self.id_prefix)

    def opening_events(
        self, request_id: str, n: int, first: RequestOutput
    ) -> Iterator[dict[str, Any]]:
        """Events sent before any output (none by default); ``first``: the first output
        (its prompt)."""
        return iter(())

    def frame(self, payload: dict[str, Any]) -> str:
        """One event as the stream sends it (OpenAI's: ``data: {json}``)."""
        return sse(payload)

    def error_event(self, exc: BaseException) -> str:
        """An error inside a started stream, as the endpoint's clients read one."""
        return sse_error(exc)

    def delta_events(
        self, request_id: str, request: Any, completion: CompletionOutput, state: dict[int, Any]
    ) -> Iterator[dict[str, Any]]:
        """The events for one sample's new output; ``state`` lives as long as the stream."""
        raise NotImplementedError

    def usage_event(self, request_id: str, total: UsageInfo) -> dict[str, Any]:
        """The last event when ``stream_options.include_usage`` is set."""
        raise NotImplementedError

    # ---- steps -----------------------------------------------------------------------

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


def longest_token_chars(tokenizer: Any) -> int:
    """The most characters one token of the vocabulary stands for (at least 1): a prompt
    of ``n`` characters has at least ``n / longest_token_chars`` tokens."""
    vocab = tokenizer.get_vocab()
    return max(1, max((len(token) for token in vocab), default=1))


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
