"""``POST /v1/completions``: complete one prompt (text or token ids), streamed or not."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from vlite.core.outputs import CompletionOutput, PositionLogprobs
from vlite.engine.input_processor import Prompt
from vlite.server.errors import OpenAIError
from vlite.server.logprobs import completion_logprobs
from vlite.server.protocol import (
    CompletionChoice,
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    UsageInfo,
)
from vlite.server.serving import Choice, OpenAIServing

#: OpenAI's default for ``/v1/completions``.
DEFAULT_MAX_TOKENS = 16


class CompletionServing(OpenAIServing):
    """Serves the legacy completions API."""

    id_prefix = "cmpl"

    async def create(self, request: CompletionRequest, raw_request: Request) -> Response:
        self.check_request(request)
        prompt = _engine_prompt(request.prompt)
        if isinstance(prompt, str):
            self.check_prompt_chars(len(prompt), "prompt")
        tokenized = await self.engine.tokenize(prompt)
        max_tokens = request.max_tokens if request.max_tokens is not None else DEFAULT_MAX_TOKENS
        self.check_length(len(tokenized["prompt_token_ids"]), max_tokens, "prompt")
        params = self.sampling_params(request, max_tokens, logprobs=request.logprobs)
        return await self.serve(request, raw_request, tokenized, params)

    def response(
        self,
        request_id: str,
        request: CompletionRequest,
        choices: list[Choice],
        total: UsageInfo,
    ) -> CompletionResponse:
        return CompletionResponse(
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
            usage=total,
        )

    def delta_events(
        self,
        request_id: str,
        request: CompletionRequest,
        completion: CompletionOutput,
        state: dict[int, Any],
    ) -> Iterator[dict[str, Any]]:
        """One event per sample's output with new text or tokens (and its last); ``state``
        holds each sample's text offset for the logprobs."""
        has_logprobs = request.logprobs is not None and completion.token_ids
        if not (completion.text or has_logprobs or completion.finished):
            return
        offset = state.get(completion.index, 0)
        choice = CompletionChoice(
            index=completion.index,
            text=completion.text,
            logprobs=_logprobs(request, completion.token_ids, completion.logprobs or [], offset),
            finish_reason=completion.finish_reason,
            stop_reason=completion.stop_reason,
        )
        if choice.logprobs is not None:  # offsets go by the tokens' text
            state[completion.index] = offset + sum(len(t) for t in choice.logprobs.tokens)
        chunk = CompletionResponse(id=request_id, model=self.served_model_name, choices=[choice])
        yield chunk.model_dump()

    def usage_event(self, request_id: str, total: UsageInfo) -> dict[str, Any]:
        chunk = CompletionResponse(
            id=request_id, model=self.served_model_name, choices=[], usage=total
        )
        return chunk.model_dump()


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
