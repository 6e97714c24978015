"""A conversation's prompt: its messages through the model's chat template, built one way
for ``/v1/chat/completions`` and ``/tokenize`` so that both count the same tokens."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vlite.core.errors import InvalidRequestError
from vlite.server.errors import OpenAIError
from vlite.server.protocol import ChatMessage

if TYPE_CHECKING:
    from vlite.server.serving import OpenAIServing


async def chat_prompt(
    serving: OpenAIServing,
    messages: list[ChatMessage],
    tools: list[dict[str, Any]] | None = None,
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    add_special_tokens: bool = False,
) -> dict[str, Any]:
    """``{"prompt": text, "prompt_token_ids": ids}`` for ``messages`` (``tools``: as the
    template takes them), templated on the engine's tokenizer threads.

    The defaults are a chat completion's; ``/tokenize`` may change them (see
    :meth:`~vlite.engine.input_processor.InputProcessor.apply_chat_template`). Messages
    longer than the context could hold are refused before templating, and messages the
    template rejects are a 400 naming ``messages``.
    """
    shown = template_messages(messages)
    serving.check_prompt_chars(sum(len(message["content"]) for message in shown), "messages")
    try:
        return await serving.engine.apply_chat_template_async(
            shown,
            tools,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            add_special_tokens=add_special_tokens,
        )
    except InvalidRequestError as exc:
        raise OpenAIError(str(exc), param="messages") from None


#: Fields of a message the chat template gets as they came: an assistant's earlier calls,
#: and a tool result's call id and function name.
TEMPLATE_PASSTHROUGH = ("tool_calls", "tool_call_id", "name")


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages for the chat template; content parts must be text (joined); the fields of
    :data:`TEMPLATE_PASSTHROUGH` (tool calls and tool results) go through unchanged."""
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
        extra = message.model_extra or {}
        passed = {key: extra[key] for key in TEMPLATE_PASSTHROUGH if extra.get(key) is not None}
        result.append({"role": message.role, "content": content or "", **passed})
    return result
