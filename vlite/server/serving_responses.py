"""``POST /v1/responses``: OpenAI's Responses API, stateless, for the clients that speak it.

The request is translated into a chat completion request
(:mod:`vlite.server.responses_to_chat`) and prepared and run by the chat endpoint's own
code, so prompts, forced tool calls and the tool-call parser behave exactly as on
``/v1/chat/completions``; only the shapes differ: the reply is a response of output items
(a ``message``, ``function_call`` items), and the stream is the Responses API's typed,
numbered events (:mod:`vlite.server.responses_events`). Errors keep OpenAI's shape.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

from fastapi import Request
from fastapi.responses import Response
from pydantic import ValidationError

from vlite.core.outputs import CompletionOutput, RequestOutput
from vlite.server.errors import complaint_error, from_exception
from vlite.server.protocol import ChatCompletionRequest, ToolCall, UsageInfo
from vlite.server.responses_events import OutputItemEvents
from vlite.server.responses_protocol import (
    ITEM_TAGS,
    IncompleteDetails,
    OutputFunctionCall,
    OutputMessage,
    OutputText,
    ResponseObject,
    ResponsesRequest,
    ResponsesUsage,
    call_id,
    response_id,
)
from vlite.server.responses_to_chat import chat_request, responses_tool_choice, responses_tools
from vlite.server.serving import Choice
from vlite.server.serving_chat import ChatServing

#: The stream's last events: a reply cut by ``max_output_tokens`` is ``incomplete``.
FINAL_EVENTS = ("response.completed", "response.incomplete")


def response_status(finish_reason: str | None) -> tuple[str, IncompleteDetails | None]:
    """The response's ``(status, incomplete_details)`` for a chat finish reason."""
    if finish_reason == "length":
        return "incomplete", IncompleteDetails(reason="max_output_tokens")
    return "completed", None


class ResponsesServing(ChatServing):
    """Serves ``POST /v1/responses`` with the chat endpoint's machinery."""

    id_prefix = "resp"
    stream_end = None  # the stream ends with response.completed (or .incomplete)

    async def create(self, raw_request: Request) -> Response:  # type: ignore[override]
        """Parse the body here rather than in FastAPI, so that a malformed one is refused
        with the complaint that names the field, like every other refusal."""
        try:
            request = parse_request(await raw_request.body())
            chat = chat_request(request)
            prompt, params = await self.prepare(chat)
            return await self.serve(chat, raw_request, prompt, params)
        except Exception as exc:
            return from_exception(exc).to_json_response()

    def new_request_id(self) -> str:
        return response_id(self.id_prefix)

    def response(
        self,
        request_id: str,
        request: ChatCompletionRequest,
        choices: list[Choice],
        total: UsageInfo,
        last: RequestOutput,
    ) -> ResponseObject:
        """The chat reply, as a response of a message item and/or function_call items."""
        (choice,) = super().response(request_id, request, choices, total, last).choices
        status, details = response_status(choice.finish_reason)
        output: list[OutputMessage | OutputFunctionCall] = []
        if choice.message.content:
            text = OutputText(text=choice.message.content)
            output.append(OutputMessage(content=[text], status=status))
        output += [_function_call(call, status) for call in choice.message.tool_calls or []]
        usage = _usage(total.prompt_tokens, total.completion_tokens)
        return self._snapshot(request_id, request, output, status, details, usage)

    def opening_events(
        self, request_id: str, n: int, first: RequestOutput
    ) -> Iterator[dict[str, Any]]:
        """None here (not chat's role chunks): :meth:`delta_events` opens the stream, as
        the request's settings, echoed in its snapshots, are known there."""
        return iter(())

    def delta_events(
        self,
        request_id: str,
        request: ChatCompletionRequest,
        completion: CompletionOutput,
        state: dict[Any, Any],
    ) -> Iterator[dict[str, Any]]:
        """``response.created`` and ``response.in_progress`` first; the chat's deltas as
        output-item events; at the end, the last item's closing events and
        ``response.completed`` (``response.incomplete`` when cut), whose usage
        :meth:`_closing_events` fills in."""
        items: OutputItemEvents | None = state.get("items")
        if items is None:
            items = state["items"] = OutputItemEvents()
            snapshot = self._snapshot(request_id, request, [], "in_progress").model_dump()
            for number, kind in enumerate(("response.created", "response.in_progress")):
                yield {"type": kind, "sequence_number": number, "response": snapshot}
        finish_reason = None
        for chunk in super().delta_events(request_id, request, completion, state):
            choice = chunk["choices"][0]
            yield from items.feed(choice["delta"])
            finish_reason = choice["finish_reason"] or finish_reason
        if not completion.finished:
            return
        status, details = response_status(finish_reason)
        yield from items.close(status)
        final = self._snapshot(request_id, request, [], status, details).model_dump()
        final["output"] = items.items
        yield items.event({"type": f"response.{status}", "response": final})

    def _closing_events(
        self,
        request_id: str,
        request: ChatCompletionRequest,
        last: RequestOutput,
        num_tokens: int,
        payloads: list[dict[str, Any]],
    ) -> list[dict[str, Any]]:
        """The final event's usage: the prompt's tokens are known only here."""
        payloads = super()._closing_events(request_id, request, last, num_tokens, payloads)
        for payload in payloads:
            if payload["type"] in FINAL_EVENTS:
                usage = _usage(len(last.prompt_token_ids), num_tokens)
                payload["response"]["usage"] = usage.model_dump()
        return payloads

    def _snapshot(
        self,
        request_id: str,
        request: ChatCompletionRequest,
        output: list[OutputMessage | OutputFunctionCall],
        status: str,
        details: IncompleteDetails | None = None,
        usage: ResponsesUsage | None = None,
    ) -> ResponseObject:
        """The response as it stands: its output so far, the request's settings echoed."""
        return ResponseObject(
            id=request_id,
            created_at=int(time.time()),
            status=status,
            incomplete_details=details,
            model=self.served_model_name,
            output=output,
            max_output_tokens=request.max_tokens,
            temperature=request.temperature,
            top_p=request.top_p,
            tools=responses_tools(request),
            tool_choice=responses_tool_choice(request),
            parallel_tool_calls=request.parallel_tool_calls,
            usage=usage,
        )

    def frame(self, payload: dict[str, Any]) -> str:
        """The Responses API's events are named: ``event: {type}`` before the data."""
        data = json.dumps(payload, ensure_ascii=False)
        return f"event: {payload['type']}\ndata: {data}\n\n"

    def error_event(self, exc: BaseException) -> str:
        error = from_exception(exc)
        payload = {
            "type": "error",
            "code": str(error.status),
            "message": error.message,
            "param": error.param,
            "sequence_number": 0,
        }
        return self.frame(payload)


def parse_request(body: bytes) -> ResponsesRequest:
    """The request in ``body``.

    Raises:
        OpenAIError: the body is not a valid request; the complaint named is the deepest
            one, with the union branches and item tags pydantic tried left out of its
            field path (a bad part in ``content`` is not reported as "content should be a
            string").
    """
    try:
        return ResponsesRequest.model_validate_json(body)
    except ValidationError as exc:
        deepest = max(exc.errors(), key=lambda complaint: len(complaint["loc"]))
        location = tuple(
            part
            for part in deepest["loc"]
            if "[" not in str(part) and part not in ITEM_TAGS and part != "str"
        )
        raise complaint_error({**deepest, "loc": location}) from None


def _usage(prompt_tokens: int, generated: int) -> ResponsesUsage:
    return ResponsesUsage(
        input_tokens=prompt_tokens,
        output_tokens=generated,
        total_tokens=prompt_tokens + generated,
    )


def _function_call(call: ToolCall, status: str) -> OutputFunctionCall:
    return OutputFunctionCall(
        call_id=call_id(call.id),
        name=call.function.name,
        arguments=call.function.arguments or "",
        status=status,
    )
