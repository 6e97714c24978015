"""``POST /v1/completions``: complete one prompt (text or token ids), streamed or not.

``echo: true`` answers as OpenAI's legacy API does: each choice's text starts with the
prompt's, and with ``logprobs: N`` its logprobs start with the prompt tokens' (``None`` for
the first, which nothing comes before; the engine's ``prompt_logprobs``). ``max_tokens: 0``
(with ``echo``) generates nothing: what lm-evaluation-harness' loglikelihood requests ask.
Echo is not streamed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from vlite.core.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from vlite.engine.input_processor import Prompt
from vlite.server.errors import OpenAIError
from vlite.server.logprobs import (
    completion_logprobs,
    joined_logprobs,
    prompt_logprobs_json,
    prompt_logprobs_shape,
)
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
    unsupported_fields = {
        name: unset for name, unset in OpenAIServing.unsupported_fields.items() if name != "echo"
    }

    async def create(self, request: CompletionRequest, raw_request: Request) -> Response:
        self.check_request(request)
        _check_echo(request)
        prompt = _engine_prompt(request.prompt)
        if isinstance(prompt, str):
            self.check_prompt_chars(len(prompt), "prompt")
        tokenized = await self.engine.tokenize(prompt)
        max_tokens = request.max_tokens if request.max_tokens is not None else DEFAULT_MAX_TOKENS
        self.check_length(len(tokenized["prompt_token_ids"]), max_tokens, "prompt")
        # max_tokens=0 (with echo): one token is generated, and left out of the answer.
        engine_max_tokens = 1 if max_tokens == 0 else max_tokens  # (0 only with echo)
        params = self.sampling_params(request, engine_max_tokens, logprobs=request.logprobs)
        if request.echo and request.logprobs is not None:  # the larger of the two asks
            num_top = max(request.logprobs, request.prompt_logprobs or 0)
            params = dataclasses.replace(params, prompt_logprobs=num_top)
        return await self.serve(request, raw_request, tokenized, params)

    def final_choices(self, request: CompletionRequest, choices: list[Choice]) -> list[Choice]:
        if request.max_tokens == 0:
            return [Choice(choice.index, finish_reason="length") for choice in choices]
        return choices

    def response(
        self,
        request_id: str,
        request: CompletionRequest,
        choices: list[Choice],
        total: UsageInfo,
        last: RequestOutput,
    ) -> CompletionResponse:
        echoed = self._echoed_prompt(request, last)
        prompt = last.prompt_logprobs
        return CompletionResponse(
            id=request_id,
            model=self.served_model_name,
            choices=[self._choice(request, choice, echoed, prompt) for choice in choices],
            usage=total,
        )

    def _choice(
        self,
        request: CompletionRequest,
        choice: Choice,
        echoed: tuple[str, CompletionLogProbs | None] | None,
        prompt: list | None,
    ) -> CompletionChoice:
        text, offset, prompt_logprobs = choice.text, 0, None
        if echoed is not None:
            prompt_text, prompt_logprobs = echoed
            text, offset = prompt_text + text, len(prompt_text)
        logprobs = _logprobs(request, choice.token_ids, choice.logprobs, offset)
        if prompt_logprobs is not None and logprobs is not None:
            logprobs = joined_logprobs(prompt_logprobs, logprobs)
        return CompletionChoice(
            index=choice.index,
            text=text,
            logprobs=logprobs,
            finish_reason=choice.finish_reason,
            stop_reason=choice.stop_reason,
            prompt_logprobs=prompt_logprobs_json(prompt)
            if request.prompt_logprobs is not None
            else None,
        )

    def _echoed_prompt(
        self, request: CompletionRequest, last: RequestOutput
    ) -> tuple[str, CompletionLogProbs | None] | None:
        """``(the prompt's text, its logprobs)`` to put before each choice's (``None``
        without ``echo``; the logprobs only with ``logprobs``)."""
        if not request.echo:
            return None
        tokenizer = self.engine.get_tokenizer()
        text = last.prompt if last.prompt is not None else tokenizer.decode(last.prompt_token_ids)
        if request.logprobs is None or last.prompt_logprobs is None:
            return text, None
        return text, prompt_logprobs_shape(
            last.prompt_token_ids, last.prompt_logprobs, request.logprobs, tokenizer
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


def _check_echo(request: CompletionRequest) -> None:
    if request.echo and request.stream:
        raise OpenAIError(
            "echo=true is not supported with stream=true; send the request without stream",
            param="echo",
        )
    if request.max_tokens == 0 and not request.echo:
        raise OpenAIError(
            "max_tokens=0 generates nothing: it is allowed only with echo=true (the prompt's "
            "logprobs); allowed otherwise: max_tokens >= 1",
            param="max_tokens",
        )


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
