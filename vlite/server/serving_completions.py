"""``POST /v1/completions``: complete one prompt (text or token ids), streamed or not."""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from vlite.core.outputs import RequestOutput
from vlite.engine.input_processor import Prompt
from vlite.server.errors import OpenAIError
from vlite.server.protocol import (
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    random_id,
)
from vlite.server.serving import DONE, ClientDisconnected, OpenAIServing, collect, sse, sse_error
from vlite.server.serving import usage as make_usage

#: OpenAI's default for ``/v1/completions``.
DEFAULT_MAX_TOKENS = 16


class CompletionServing(OpenAIServing):
    """Serves the legacy completions API."""

    async def create(self, request: CompletionRequest, raw_request: Request) -> Response:
        self.check_request(request)
        prompt = _engine_prompt(request.prompt)
        max_tokens = request.max_tokens if request.max_tokens is not None else DEFAULT_MAX_TOKENS
        params = self.sampling_params(request, max_tokens)
        request_id = random_id("cmpl")
        try:
            first, stream = await self.start(raw_request, request_id, prompt, params)
            if request.stream:
                events = self._stream(request_id, first, stream, request.include_usage)
                return StreamingResponse(events, media_type="text/event-stream")
            text, token_ids, last = await collect(raw_request, first, stream)
        except ClientDisconnected:
            return Response(status_code=499)
        completion = last.outputs[0]
        response = CompletionResponse(
            id=request_id,
            model=self.served_model_name,
            choices=[
                CompletionChoice(
                    text=text,
                    finish_reason=completion.finish_reason,
                    stop_reason=completion.stop_reason,
                )
            ],
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
        """SSE events: one per output with new text (and the last), then usage and [DONE]."""
        output, num_tokens = first, 0
        try:
            while True:
                completion = output.outputs[0]
                num_tokens += len(completion.token_ids)
                if completion.text or output.finished:
                    yield sse(self._chunk(request_id, output).model_dump())
                if output.finished:
                    break
                output = await anext(stream)
            if include_usage:
                usage = make_usage(len(output.prompt_token_ids), num_tokens)
                chunk = CompletionResponse(
                    id=request_id, model=self.served_model_name, choices=[], usage=usage
                )
                yield sse(chunk.model_dump())
        except Exception as exc:
            yield sse_error(exc)
        finally:
            await stream.aclose()
        yield DONE

    def _chunk(self, request_id: str, output: RequestOutput) -> CompletionResponse:
        completion = output.outputs[0]
        choice = CompletionChoice(
            text=completion.text,
            finish_reason=completion.finish_reason,
            stop_reason=completion.stop_reason,
        )
        return CompletionResponse(id=request_id, model=self.served_model_name, choices=[choice])


def _engine_prompt(prompt: str | list) -> Prompt:
    """Text or token ids; a batch of prompts is refused (one request, one prompt)."""
    if isinstance(prompt, str):
        return prompt
    if not prompt:
        raise OpenAIError("prompt=[] is invalid: it must not be empty", param="prompt")
    if all(isinstance(item, int) for item in prompt):
        return {"prompt_token_ids": list(prompt)}
    if len(prompt) == 1:  # a batch of one: ["text"] or [[1, 2, 3]]
        return _engine_prompt(prompt[0])
    raise OpenAIError(
        "prompt must be one string or one list of token ids; batches of prompts are not "
        "supported (send one request per prompt)",
        param="prompt",
    )
