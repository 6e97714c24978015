"""``POST /v1/messages``: Anthropic's Messages API, for the clients (coding agents among
them) that speak it to a local server.

The request is translated into a chat completion request
(:mod:`vlite.server.messages_to_chat`) and prepared and run by the chat endpoint's own
code, so prompts, forced tool calls and the tool-call parser behave exactly as on
``/v1/chat/completions``; only the shapes differ: the reply is a message of content
blocks, the stream is Anthropic's named events (:mod:`vlite.server.anthropic_events`), and
errors are Anthropic's ``{"type": "error", "error": {...}}``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from fastapi import Request
from fastapi.responses import Response
from pydantic import ValidationError

from vlite.core.outputs import CompletionOutput, RequestOutput
from vlite.server.anthropic_events import ContentBlockEvents
from vlite.server.anthropic_protocol import (
    MessagesRequest,
    MessagesResponse,
    MessagesUsage,
    ResponseText,
    ResponseToolUse,
    anthropic_id,
)
from vlite.server.errors import (
    ANTHROPIC_PATH,
    anthropic_error,
    complaint_error,
    error_response,
    from_exception,
)
from vlite.server.messages_to_chat import chat_request
from vlite.server.protocol import ChatCompletionRequest, ToolCall, UsageInfo
from vlite.server.serving import Choice
from vlite.server.serving_chat import ChatServing


def stop_reason(finish_reason: str | None, stopped_by: int | str | None) -> tuple[str, str | None]:
    """Anthropic's ``(stop_reason, stop_sequence)`` for a chat finish reason and the
    engine's ``stop_reason`` (the stop string that matched, if one did)."""
    if finish_reason == "tool_calls":
        return "tool_use", None
    if finish_reason == "length":
        return "max_tokens", None
    if finish_reason == "stop" and isinstance(stopped_by, str):
        return "stop_sequence", stopped_by
    return "end_turn", None


class MessagesServing(ChatServing):
    """Serves ``POST /v1/messages`` with the chat endpoint's machinery."""

    id_prefix = "msg"
    stream_end = None  # Anthropic's stream ends with message_stop

    async def create(self, raw_request: Request) -> Response:  # type: ignore[override]
        """Parse the body here rather than in FastAPI, so that a malformed one is answered
        in Anthropic's error shape like every other refusal before the stream starts."""
        try:
            request = parse_request(await raw_request.body())
            chat = chat_request(request)
            prompt, params = await self.prepare(chat)
            return await self.serve(chat, raw_request, prompt, params)
        except Exception as exc:
            return error_response(from_exception(exc), ANTHROPIC_PATH)

    def new_request_id(self) -> str:
        return anthropic_id(self.id_prefix)

    def response(
        self,
        request_id: str,
        request: ChatCompletionRequest,
        choices: list[Choice],
        total: UsageInfo,
        last: RequestOutput,
    ) -> MessagesResponse:
        """The chat reply, as a message of a text block and/or tool_use blocks."""
        (choice,) = super().response(request_id, request, choices, total, last).choices
        content: list[ResponseText | ResponseToolUse] = []
        if choice.message.content:
            content.append(ResponseText(text=choice.message.content))
        content += [_tool_use(call) for call in choice.message.tool_calls or []]
        reason, sequence = stop_reason(choice.finish_reason, choice.stop_reason)
        return MessagesResponse(
            id=request_id,
            model=self.served_model_name,
            content=content,
            stop_reason=reason,
            stop_sequence=sequence,
            usage=MessagesUsage(
                input_tokens=total.prompt_tokens, output_tokens=total.completion_tokens
            ),
        )

    def opening_events(
        self, request_id: str, n: int, first: RequestOutput
    ) -> Iterator[dict[str, Any]]:
        """``message_start``: the message, with no content yet and the prompt's usage."""
        message = MessagesResponse(
            id=request_id,
            model=self.served_model_name,
            content=[],
            stop_reason=None,
            usage=MessagesUsage(input_tokens=len(first.prompt_token_ids), output_tokens=0),
        )
        yield {"type": "message_start", "message": message.model_dump()}

    def delta_events(
        self,
        request_id: str,
        request: ChatCompletionRequest,
        completion: CompletionOutput,
        state: dict[Any, Any],
    ) -> Iterator[dict[str, Any]]:
        """The chat's deltas as block events; at the end, the last block's stop,
        ``message_delta`` (stop reason, output tokens) and ``message_stop``."""
        blocks: ContentBlockEvents = state.setdefault("blocks", ContentBlockEvents())
        state["num_tokens"] = state.get("num_tokens", 0) + len(completion.token_ids)
        finish_reason = None
        for chunk in super().delta_events(request_id, request, completion, state):
            choice = chunk["choices"][0]
            yield from blocks.feed(choice["delta"])
            finish_reason = choice["finish_reason"] or finish_reason
        if not completion.finished:
            return
        yield from blocks.close()
        reason, sequence = stop_reason(finish_reason, completion.stop_reason)
        yield {
            "type": "message_delta",
            "delta": {"stop_reason": reason, "stop_sequence": sequence},
            "usage": {"output_tokens": state["num_tokens"]},
        }
        yield {"type": "message_stop"}

    def frame(self, payload: dict[str, Any]) -> str:
        """Anthropic's events are named: ``event: {type}`` before the data."""
        data = json.dumps(payload, ensure_ascii=False)
        return f"event: {payload['type']}\ndata: {data}\n\n"

    def error_event(self, exc: BaseException) -> str:
        return self.frame(anthropic_error(from_exception(exc)).model_dump())


def parse_request(body: bytes) -> MessagesRequest:
    """The request in ``body``.

    Raises:
        OpenAIError: the body is not a valid request; the complaint named is the deepest
            one, with the union branches pydantic tried left out of its field path (a bad
            block in ``content`` is not reported as "content should be a string").
    """
    try:
        return MessagesRequest.model_validate_json(body)
    except ValidationError as exc:
        deepest = max(exc.errors(), key=lambda complaint: len(complaint["loc"]))
        location = tuple(part for part in deepest["loc"] if "[" not in str(part))
        raise complaint_error({**deepest, "loc": location}) from None


def _tool_use(call: ToolCall) -> ResponseToolUse:
    """A chat tool call as a ``tool_use`` block; its arguments are JSON (the constraint or
    the tool-call parser saw to it), an object for every tool Anthropic's schemas allow."""
    arguments = json.loads(call.function.arguments or "{}")
    return ResponseToolUse(name=call.function.name, input=arguments)
