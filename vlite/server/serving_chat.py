"""``POST /v1/chat/completions``: reply to a conversation, streamed or not."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from vlite.core.errors import InvalidRequestError
from vlite.core.outputs import PositionLogprobs, RequestOutput
from vlite.core.sampling_params import MAX_LOGPROBS
from vlite.server.errors import OpenAIError
from vlite.server.logprobs import chat_logprobs
from vlite.server.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogProbs,
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
        num_top = _num_top_logprobs(request)
        try:
            prompt = self.engine.apply_chat_template(_template_messages(request.messages))
        except InvalidRequestError as exc:
            raise OpenAIError(str(exc), param="messages") from None
        max_tokens = request.max_completion_tokens or request.max_tokens
        if max_tokens is None:
            max_tokens = self.default_max_tokens(len(prompt["prompt_token_ids"]))
        params = self.sampling_params(request, max_tokens, logprobs=num_top)
        request_id = random_id("chatcmpl")
        try:
            first, stream = await self.start(raw_request, request_id, prompt, params)
            if request.stream:
                events = self._stream(request_id, first, stream, request, params.n)
                return StreamingResponse(events, media_type="text/event-stream")
            choices, last = await collect(raw_request, first, stream, params.n)
        except ClientDisconnected:
            return Response(status_code=499)
        response = ChatCompletionResponse(
            id=request_id,
            model=self.served_model_name,
            choices=[
                ChatChoice(
                    index=choice.index,
                    message=ChatResponseMessage(content=choice.text),
                    logprobs=_logprobs(num_top, choice.token_ids, choice.logprobs),
                    finish_reason=choice.finish_reason,
                    stop_reason=choice.stop_reason,
                )
                for choice in choices
            ],
            usage=make_usage(
                len(last.prompt_token_ids), sum(len(choice.token_ids) for choice in choices)
            ),
        )
        return JSONResponse(response.model_dump())

    async def _stream(
        self,
        request_id: str,
        first: RequestOutput,
        stream: AsyncIterator[RequestOutput],
        request: ChatCompletionRequest,
        n: int,
    ) -> AsyncIterator[str]:
        """SSE events: the assistant role of each choice, content deltas, each choice's
        finish reason, usage (if asked), [DONE]. Every chunk names its choice's index."""
        num_top = _num_top_logprobs(request)
        for index in range(n):
            yield sse(self._chunk(request_id, index, DeltaMessage(role="assistant", content="")))
        output, num_tokens = first, 0
        try:
            while True:
                for completion in output.outputs:
                    num_tokens += len(completion.token_ids)
                    logprobs = _logprobs(num_top, completion.token_ids, completion.logprobs or [])
                    if completion.text or (logprobs is not None and completion.token_ids):
                        delta = DeltaMessage(content=completion.text)
                        chunk = self._chunk(request_id, completion.index, delta, logprobs=logprobs)
                        yield sse(chunk)
                    if completion.finished:
                        finish = self._chunk(
                            request_id, completion.index, DeltaMessage(), completion.finish_reason
                        )
                        yield sse(finish)
                if output.finished:
                    break
                output = await anext(stream)
            if request.include_usage:
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
        self,
        request_id: str,
        index: int,
        delta: DeltaMessage,
        finish_reason: str | None = None,
        logprobs: ChatLogProbs | None = None,
    ) -> dict[str, Any]:
        choice = ChatStreamChoice(
            index=index, delta=delta, logprobs=logprobs, finish_reason=finish_reason
        )
        chunk = ChatCompletionChunk(id=request_id, model=self.served_model_name, choices=[choice])
        payload = chunk.model_dump(exclude={"usage"})
        # OpenAI sends only the delta's present keys, but null finish_reason and logprobs.
        payload["choices"][0]["delta"] = delta.model_dump(exclude_none=True)
        return payload


def _num_top_logprobs(request: ChatCompletionRequest) -> int | None:
    """The engine's ``logprobs`` for a chat request: ``None`` unless ``logprobs`` is true."""
    top = request.top_logprobs
    if top is not None and not 0 <= top <= MAX_LOGPROBS:
        raise OpenAIError(
            f"top_logprobs={top!r} is invalid: must be an integer in [0, {MAX_LOGPROBS}]",
            param="top_logprobs",
        )
    if not request.logprobs:
        if top:
            raise OpenAIError(f"top_logprobs={top!r} needs logprobs=true", param="top_logprobs")
        return None
    return top or 0


def _logprobs(
    num_top: int | None, token_ids: list[int], logprobs: list[PositionLogprobs]
) -> ChatLogProbs | None:
    if num_top is None:
        return None
    return chat_logprobs(token_ids, logprobs, num_top)


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
