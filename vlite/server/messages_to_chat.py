"""An Anthropic Messages request as the chat completion request it means, so that
``/v1/messages`` runs through the chat endpoint's prompt, tool plan and tool-call parser
instead of a second copy of them.

- ``system`` becomes the first message (role ``system``);
- an assistant's ``tool_use`` blocks become that message's ``tool_calls`` (arguments as a
  JSON string, as OpenAI clients send them to ``/v1/chat/completions``);
- a user's ``tool_result`` blocks become ``role: "tool"`` messages with ``tool_call_id``
  and the called function's ``name`` (templates that show it find it), in block order
  with the user's text around them; ``is_error`` prefixes the result with ``Error: ``;
- ``tool_choice``: ``auto`` -> ``"auto"``, ``any`` -> ``"required"``, ``tool`` -> that
  function, ``none`` -> ``"none"``; ``disable_parallel_tool_use`` ->
  ``parallel_tool_calls: false``;
- ``stop_sequences`` -> ``stop``; ``max_tokens``, ``temperature``, ``top_p``, ``top_k``
  and ``stream`` as they are.
"""

from __future__ import annotations

import json
from typing import Any

from vlite.server.anthropic_protocol import (
    InputMessage,
    MessagesRequest,
    TextBlock,
    Tool,
    ToolChoice,
    ToolResultBlock,
    ToolUseBlock,
)
from vlite.server.errors import OpenAIError
from vlite.server.protocol import ChatCompletionRequest, ChatMessage


def chat_request(request: MessagesRequest) -> ChatCompletionRequest:
    """The chat completion request ``request`` stands for.

    Raises:
        OpenAIError: a block in a message of the wrong role, ``tool_choice`` of type
            ``tool`` without a name.
    """
    choice = request.tool_choice
    return ChatCompletionRequest(
        model=request.model,
        messages=chat_messages(request),
        max_tokens=request.max_tokens,
        stop=request.stop_sequences,
        temperature=request.temperature,
        top_p=request.top_p,
        top_k=request.top_k,
        stream=request.stream,
        tools=[_chat_tool(tool) for tool in request.tools] if request.tools else None,
        tool_choice=_chat_tool_choice(choice),
        parallel_tool_calls=not (choice and choice.disable_parallel_tool_use),
    )


def chat_messages(request: MessagesRequest) -> list[ChatMessage]:
    """The conversation, ``system`` first, with tool calls and results in chat's shape."""
    messages = []
    if request.system:
        messages.append(ChatMessage(role="system", content=_joined(request.system)))
    function_names: dict[str, str] = {}  # tool_use id -> name, for the results
    for index, message in enumerate(request.messages):
        messages += _chat_messages(index, message, function_names)
    return messages


def _chat_messages(
    index: int, message: InputMessage, function_names: dict[str, str]
) -> list[ChatMessage]:
    if isinstance(message.content, str):
        return [ChatMessage(role=message.role, content=message.content)]
    wrong = ToolResultBlock if message.role == "assistant" else ToolUseBlock
    for position, block in enumerate(message.content):
        if isinstance(block, wrong):
            raise OpenAIError(
                f"messages[{index}].content[{position}] is a {block.type} block, which a "
                f"{message.role} message cannot hold",
                param=f"messages.{index}.content.{position}",
            )
    if message.role == "assistant":
        return [_assistant_message(message.content, function_names)]
    return _user_messages(message.content, function_names)


def _assistant_message(blocks: list[Any], function_names: dict[str, str]) -> ChatMessage:
    text = "".join(block.text for block in blocks if isinstance(block, TextBlock))
    calls = []
    for block in blocks:
        if isinstance(block, ToolUseBlock):
            function_names[block.id] = block.name
            arguments = json.dumps(block.input, ensure_ascii=False)
            function = {"name": block.name, "arguments": arguments}
            calls.append({"id": block.id, "type": "function", "function": function})
    return ChatMessage(role="assistant", content=text, tool_calls=calls or None)


def _user_messages(blocks: list[Any], function_names: dict[str, str]) -> list[ChatMessage]:
    """Each run of text blocks is one user message; each result a tool message."""
    messages: list[ChatMessage] = []
    texts: list[str] = []
    for block in blocks:
        if isinstance(block, TextBlock):
            texts.append(block.text)
            continue
        if texts:
            messages.append(ChatMessage(role="user", content="".join(texts)))
            texts = []
        messages.append(_tool_message(block, function_names))
    if texts or not messages:
        messages.append(ChatMessage(role="user", content="".join(texts)))
    return messages


def _tool_message(block: ToolResultBlock, function_names: dict[str, str]) -> ChatMessage:
    content = _joined(block.content)
    if block.is_error:
        content = f"Error: {content}"
    return ChatMessage(
        role="tool",
        content=content,
        tool_call_id=block.tool_use_id,
        name=function_names.get(block.tool_use_id),
    )


def _joined(content: str | list[TextBlock]) -> str:
    return content if isinstance(content, str) else "".join(block.text for block in content)


def _chat_tool(tool: Tool) -> dict[str, Any]:
    function = {"name": tool.name, "parameters": tool.input_schema}
    if tool.description is not None:
        function["description"] = tool.description
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: ToolChoice | None) -> Any:
    if choice is None:
        return None
    if choice.type == "tool":
        if not choice.name:
            raise OpenAIError(
                "tool_choice of type 'tool' needs the name of a tool", param="tool_choice.name"
            )
        return {"type": "function", "function": {"name": choice.name}}
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type]
