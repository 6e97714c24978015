"""``POST /tokenize`` and ``POST /detokenize``: vLLM's tokenizer endpoints.

A client counts a prompt's tokens before sending it (does it fit the context?), or maps ids
back to text, with the server's own tokenizer and chat template: ``/tokenize`` of a text
gives the ids ``/v1/completions`` generates from, of ``messages`` those of
``/v1/chat/completions`` (same code paths). The count may exceed ``max_model_len``: that is
the answer the client asked for (a text too long to fit even at the longest tokens is
refused untokenized, as by the completions endpoints).
"""

from __future__ import annotations

from vlite.core.errors import InvalidRequestError
from vlite.server.chat_prompt import chat_prompt
from vlite.server.errors import OpenAIError
from vlite.server.output_constraints import template_tools
from vlite.server.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
)
from vlite.server.serving import OpenAIServing

#: Fields that shape a conversation's template, meaningless for a text prompt.
CHAT_ONLY_FIELDS = ("add_generation_prompt", "continue_final_message", "tools")


class TokenizeServing(OpenAIServing):
    """Serves ``/tokenize`` and ``/detokenize`` (nothing is generated: only the model's
    name and the prompt limits of :class:`OpenAIServing` apply)."""

    async def tokenize(self, request: TokenizeRequest) -> TokenizeResponse:
        self.check_model(request.model)
        if request.messages is None:
            prompt = await self._text_prompt(request)
        else:
            prompt = await self._chat_prompt(request)
        ids = prompt["prompt_token_ids"]
        tokenizer = self.engine.get_tokenizer()
        return TokenizeResponse(
            count=len(ids),
            max_model_len=self.engine.max_model_len,
            tokens=ids,
            token_strs=tokenizer.convert_ids_to_tokens(ids) if request.return_token_strs else None,
        )

    async def detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse:
        self.check_model(request.model)
        try:
            text = await self.engine.detokenize(request.tokens)
        except InvalidRequestError as exc:
            raise OpenAIError(str(exc), param="tokens") from None
        return DetokenizeResponse(prompt=text)

    async def _text_prompt(self, request: TokenizeRequest) -> dict:
        """The ids of ``prompt``, with the BOS a completion gets unless told otherwise."""
        if request.prompt is None:
            raise OpenAIError(
                "prompt (a text) or messages (a conversation) is required", param="prompt"
            )
        for name in CHAT_ONLY_FIELDS:
            if name in request.model_fields_set:
                raise OpenAIError(
                    f"{name} applies to messages, not to a prompt; leave it unset", param=name
                )
        self.check_prompt_chars(len(request.prompt), "prompt")
        add_special_tokens = request.add_special_tokens is not False
        return await self.engine.tokenize(request.prompt, add_special_tokens=add_special_tokens)

    async def _chat_prompt(self, request: TokenizeRequest) -> dict:
        """The ids of ``messages`` through the chat template, as chat completions get them."""
        if request.prompt is not None:
            raise OpenAIError(
                "messages and prompt cannot go together: send one of them", param="messages"
            )
        if not request.messages:
            raise OpenAIError("messages must hold at least one message", param="messages")
        continue_final = request.continue_final_message
        add_generation = request.add_generation_prompt
        if add_generation is None:
            add_generation = not continue_final
        if add_generation and continue_final:
            raise OpenAIError(
                "continue_final_message=true leaves the last message open; it cannot go with "
                "add_generation_prompt=true, which opens a new reply after it",
                param="continue_final_message",
            )
        return await chat_prompt(
            self,
            request.messages,
            template_tools(request.tools) if request.tools else None,
            add_generation_prompt=add_generation,
            continue_final_message=continue_final,
            add_special_tokens=bool(request.add_special_tokens),
        )
