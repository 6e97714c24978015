"""``POST /v1/chat/completions``: reply to a conversation, streamed or not."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from vlite.core.outputs import RequestOutput
from vlite.server.errors import OpenAIError
from vlite.server.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    ChatResponseMessage,
    ChatStreamChoice,
    DeltaMessage,
    random_id,
)
from vlite.server.serving import DONE, ClientDisconnected, OpenAIServing, collect, sse, sse_error
from vlite.server.serving import usage as make_usage


class ChatServing(OpenAIServing):
    """Serves the chat completions API with the model's chat template."""

    async def create(self, request: ChatCompletionRequest, raw_request: Request) -> Response:
        self.check_request(request)
        try:
            prompt = self.engine.apply_chat_template(_template_messages(request.messages))
        except ValueError as exc:
            raise OpenAIError(str(exc), param="messages") from None
        max_tokens = request.max_completion_tokens or request.max_tokens
        if max_tokens is None:
            max_tokens = self.default_max_tokens(len(prompt["prompt_token_ids"]))
        params = self.sampling_params(request, max_tokens)
        request_id = random_id("chatcmpl")
        try:
            first, stream = await self.start(raw_request, request_id, prompt, params)
            if request.stream:
                events = self._stream(request_id, first, stream, request.include_usage)
                return StreamingResponse(events, media_type="text/event-stream")
            text, token_ids, last = await collect(raw_request, first, stream)
        except ClientDisconnected:
            return Response(status_code=499)
        completion = last.outputs[0]
        choice = ChatChoice(
            message=ChatResponseMessage(content=text),
            finish_reason=completion.finish_reason,
            stop_reason=completion.stop_reason,
        )
        response = ChatCompletionResponse(
            id=request_id,
            model=self.served_model_name,
            choices=[choice],
            usage=make_usage(len(last.prompt_token_ids), len(token_ids)),
        )
        return JSONResponse(response.model_dump())

    async def _stream(
        self,
        request_id: str,
        first: RequestOutput,
        stream: AsyncIterator[RequestOutput],
        include_usage: bool,
    ) -> AsyncIterator[str]:
        """SSE events: the assistant role, content deltas, the finish reason, [DONE]."""
        yield sse(self._chunk(request_id, DeltaMessage(role="assistant", content="")))
        output, num_tokens = first, 0
        try:
            while True:
                completion = output.outputs[0]
                num_tokens += len(completion.token_ids)
                if completion.text:
                    yield sse(self._chunk(request_id, DeltaMessage(content=completion.text)))
                if output.finished:
                    break
                output = await anext(stream)
            yield sse(self._chunk(request_id, DeltaMessage(), completion.finish_reason))
            if include_usage:
                chunk = ChatCompletionChunk(
                    id=request_id,
                    model=self.served_model_name,
                    choices=[],
                    usage=make_usage(len(output.prompt_token_ids), num_tokens),
                )
                yield sse(chunk.model_dump(exclude_none=True))
        except Exception as exc:
            yield sse_error(exc)
        finally:
            await stream.aclose()
        yield DONE

    def _chunk(
        self, request_id: str, delta: DeltaMessage, finish_reason: str | None = None
    ) -> dict[str, Any]:
        choice = ChatStreamChoice(delta=delta, finish_reason=finish_reason)
        chunk = ChatCompletionChunk(id=request_id, model=self.served_model_name, choices=[choice])
        payload = chunk.model_dump(exclude={"usage"})
        # OpenAI sends only the delta's present keys, but null finish_reason and logprobs.
        payload["choices"][0]["delta"] = delta.model_dump(exclude_none=True)
        return payload


def _template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages for the chat template; content parts must be text (joined)."""
    result = []
    for index, message in enumerate(messages):
        content = message.content
        if isinstance(content, list):
            if any(part.get("type") != "text" for part in content):
                raise OpenAIError(
                    f"messages[{index}].content has a non-text part; only text is supported",
                    param=f"messages.{index}.content",
                )
            content = "".join(str(part.get("text", "")) for part in content)
        result.append({"role": message.role, "content": content or ""})
    return result
