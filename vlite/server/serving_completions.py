"""``POST /v1/completions``: complete one prompt (text or token ids), streamed or not."""

from __future__ import annotations

from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from vlite.core.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from vlite.engine.input_processor import Prompt
from vlite.server.errors import OpenAIError
from vlite.server.logprobs import completion_logprobs
from vlite.server.protocol import (
    CompletionChoice,
    CompletionLogProbs,
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
        params = self.sampling_params(request, max_tokens, logprobs=request.logprobs)
        request_id = random_id("cmpl")
        try:
            first, stream = await self.start(raw_request, request_id, prompt, params)
            if request.stream:
                events = self._stream(request_id, first, stream, request)
                return StreamingResponse(events, media_type="text/event-stream")
            choices, last = await collect(raw_request, first, stream, params.n)
        except ClientDisconnected:
            return Response(status_code=499)
        response = CompletionResponse(
            id=request_id,
            model=self.served_model_name,
            choices=[
                CompletionChoice(
                    index=choice.index,
                    text=choice.text,
                    logprobs=_logprobs(request, choice.token_ids, choice.logprobs),
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
        request: CompletionRequest,
    ) -> AsyncIterator[str]:
        """SSE events: one per sample's output with new text or tokens (and its last), then
        usage and [DONE]. Each chunk's choice carries the sample's ``index``."""
        output, num_tokens = first, 0
        text_offsets: dict[int, int] = {}
        try:
            while True:
                for completion in output.outputs:
                    num_tokens += len(completion.token_ids)
                    has_logprobs = request.logprobs is not None and completion.token_ids
                    if completion.text or has_logprobs or completion.finished:
                        offset = text_offsets.get(completion.index, 0)
                        choice = self._choice(request, completion, offset)
                        if choice.logprobs is not None:  # offsets go by the tokens' text
                            text_offsets[completion.index] = offset + sum(
                                len(token) for token in choice.logprobs.tokens
                            )
                        chunk = CompletionResponse(
                            id=request_id, model=self.served_model_name, choices=[choice]
                        )
                        yield sse(chunk.model_dump())
                if output.finished:
                    break
                output = await anext(stream)
            if request.include_usage:
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

    @staticmethod
    def _choice(
        request: CompletionRequest, completion: CompletionOutput, text_offset: int
    ) -> CompletionChoice:
        return CompletionChoice(
            index=completion.index,
            text=completion.text,
            logprobs=_logprobs(
                request, completion.token_ids, completion.logprobs or [], text_offset
            ),
            finish_reason=completion.finish_reason,
            stop_reason=completion.stop_reason,
        )


def _logprobs(
    request: CompletionRequest,
    token_ids: list[int],
    logprobs: list[PositionLogprobs],
    text_offset: int = 0,
) -> CompletionLogProbs | None:
    if request.logprobs is None:
        return None
    return completion_logprobs(token_ids, logprobs, request.logprobs, text_offset)


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
