"""InputProcessor: prompts (text, token ids or chat messages) -> EngineCoreRequest.

Shared by the offline :class:`~vlite.engine.llm_engine.LLMEngine` and the online
:class:`~vlite.engine.async_llm.AsyncLLM`, so both tokenize and template the same way.
"""

from __future__ import annotations

import operator
import time
from collections.abc import Callable
from typing import Any

from vlite.core.errors import InvalidRequestError
from vlite.core.request import EngineCoreRequest
from vlite.core.sampling_params import SamplingParams
from vlite.core.structured_output_params import StructuredOutputsParams
from vlite.engine.output_controls import prepare_output_controls

#: A prompt: text, or ``{"prompt_token_ids": [...]}`` (optionally with its ``"prompt"`` text).
Prompt = str | dict[str, Any]


class InputProcessor:
    """Tokenizes prompts and applies chat templates with one Hugging Face tokenizer.

    Args:
        tokenizer: a Hugging Face tokenizer.
        vocab_size: the model's vocabulary size; token ids given directly must be below it
            (an out-of-range id would fail the whole batch's forward pass in the core).
        validate_structured: checks a request's ``structured_outputs`` (see
            :class:`~vlite.engine.output_controls.StructuredOutputValidator`); ``None``
            leaves it to the engine core.
    """

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int | None = None,
        validate_structured: Callable[[StructuredOutputsParams], None] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.validate_structured = validate_structured

    @property
    def eos_token_id(self) -> int | None:
        return self.tokenizer.eos_token_id

    def tokenize(
        self, prompt: Prompt, *, add_special_tokens: bool = True
    ) -> tuple[str | None, list[int]]:
        """``(text, token_ids)`` of a prompt; text is ``None`` for bare token ids.

        ``add_special_tokens``: whether text gets the tokenizer's own (a BOS), as every
        prompt that is generated from does; ``/tokenize`` may ask for the bare text's.
        """
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            token_ids = _token_id_list(prompt["prompt_token_ids"])
            if self.vocab_size is not None and any(t >= self.vocab_size for t in token_ids):
                raise InvalidRequestError(
                    f"prompt_token_ids holds {max(token_ids)}, outside the model's vocabulary "
                    f"(ids must be < {self.vocab_size})"
                )
            return prompt.get("prompt"), token_ids
        raise InvalidRequestError(
            f"prompt={prompt!r:.80} is invalid: expected a string or a dict with 'prompt_token_ids'"
        )

    def process(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams,
        priority: int = 0,
    ) -> tuple[EngineCoreRequest, str | None]:
        """The request to send to the engine core, and the prompt's text (if known).

        Raises:
            InvalidRequestError: a bad prompt, a token id outside the vocabulary, or a
                structured-output constraint that cannot compile.
        """
        text, token_ids = self.tokenize(prompt)
        params = prepare_output_controls(
            params, self.tokenizer, self.vocab_size, self.validate_structured
        )
        core_request = EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=token_ids,
            sampling_params=params,
            eos_token_id=self.eos_token_id,
            arrival_time=time.monotonic(),
            priority=priority,
        )
        return core_request, text

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        add_special_tokens: bool = False,
    ) -> dict[str, Any]:
        """A prompt dict (text and token ids) for a conversation, ready for a reply
        (``tools``: OpenAI-style tool definitions, for templates that show them).

        The defaults are what a chat completion generates from. ``/tokenize`` may ask for
        the conversation without the reply's opening (``add_generation_prompt=False``),
        with its last message left open for the model to go on with
        (``continue_final_message``), or with the tokenizer's special tokens added on top of
        the template's (``add_special_tokens``): the meanings of vLLM and ``transformers``.

        Raises:
            InvalidRequestError: the tokenizer has no chat template, or the messages do not
                fit it.
        """
        if not getattr(self.tokenizer, "chat_template", None):
            raise InvalidRequestError(
                "the model's tokenizer has no chat template; send plain prompts"
            )
        from jinja2 import TemplateError

        try:
            text = self.tokenizer.apply_chat_template(
                messages,
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                tokenize=False,
            )
        except (TemplateError, ValueError, TypeError) as exc:
            # The template rejected these messages (its raise_exception, an undefined
            # field), or the tokenizer their shape: the request's fault. Anything else is
            # a fault of ours or the tokenizer's and keeps its traceback.
            raise InvalidRequestError(
                f"the chat template could not format the messages: {exc}"
            ) from exc
        token_ids = self.tokenizer.encode(text, add_special_tokens=add_special_tokens)
        return {"prompt": text, "prompt_token_ids": token_ids}

    def detokenize(self, token_ids: list[int]) -> str:
        """The text of ``token_ids``, special tokens included (vLLM's ``/detokenize``).

        Raises:
            InvalidRequestError: an id outside the vocabulary, which the tokenizer would
                silently drop.
        """
        limit = self.vocab_size if self.vocab_size is not None else len(self.tokenizer)
        for position, token_id in enumerate(token_ids):
            if not 0 <= token_id < limit:
                raise InvalidRequestError(
                    f"token {position} is {token_id}, outside the model's vocabulary "
                    f"(ids must be in [0, {limit}))"
                )
        return self.tokenizer.decode(token_ids)


def _token_id_list(token_ids: Any) -> list[int]:
    """``token_ids`` as a list of Python ints; anything else is an invalid request."""
    try:
        ids = [operator.index(t) for t in token_ids]
    except TypeError:
        ids = None
    if ids is None or any(t < 0 for t in ids) or isinstance(token_ids, (str, bytes)):
        raise InvalidRequestError(
            f"prompt_token_ids={token_ids!r:.80} is invalid: must be a list of integers >= 0"
        )
    return ids
