"""A Responses API request as the chat completion request it means, so that
``/v1/responses`` runs through the chat endpoint's prompt, tool plan and tool-call parser.

- ``instructions`` becomes the first message (role ``system``);
- a message item keeps its role (``developer`` becomes ``system``, which every chat
  template knows) and its text parts joined;
- ``function_call`` items become the ``tool_calls`` of an assistant message (appended to
  the assistant message just before them, if there is one);
- ``function_call_output`` items become ``role: "tool"`` messages with ``tool_call_id`` and
  the called function's ``name``;
- ``tools`` go from the flat ``{"type": "function", "name", "parameters"}`` to chat's
  nested ``{"type": "function", "function": {...}}``; ``tool_choice``
  ``{"type": "function", "name"}`` likewise;
- ``max_output_tokens`` -> ``max_tokens``; ``temperature``, ``top_p``, ``stream`` and
  ``parallel_tool_calls`` as they are.
"""

from __future__ import annotations

from typing import Any

from vlite.server.errors import OpenAIError
from vlite.server.protocol import ChatCompletionRequest, ChatMessage
from vlite.server.responses_protocol import (
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionTool,
    FunctionToolChoice,
    MessageItem,
    ResponsesRequest,
)


def chat_request(request: ResponsesRequest) -> ChatCompletionRequest:
    """The chat completion request ``request`` stands for.

    Raises:
        OpenAIError: ``store: true`` or ``previous_response_id`` (nothing is stored), an
            empty conversation.
    """
    if request.store:
        raise OpenAIError(
            "store=true is not supported: this server keeps no responses; send store=false",
            param="store",
        )
    if request.previous_response_id is not None:
        raise OpenAIError(
            "previous_response_id is not supported: this server keeps no responses; send "
            "the whole conversation in input",
            param="previous_response_id",
        )
    parallel = request.parallel_tool_calls
    return ChatCompletionRequest(
        model=request.model,
        messages=chat_messages(request),
        max_tokens=request.max_output_tokens,
        temperature=request.temperature,
        top_p=request.top_p,
        stream=request.stream,
        tools=[_chat_tool(tool) for tool in request.tools] if request.tools else None,
        tool_choice=_chat_tool_choice(request.tool_choice),
        parallel_tool_calls=True if parallel is None else parallel,
    )


def chat_messages(request: ResponsesRequest) -> list[ChatMessage]:
    """The conversation, ``instructions`` first, with calls and results in chat's shape."""
    messages = []
    if request.instructions:
        messages.append(ChatMessage(role="system", content=request.instructions))
    if isinstance(request.input, str):
        return [*messages, ChatMessage(role="user", content=request.input)]
    function_names: dict[str, str] = {}  # call_id -> name, for the results
    for item in request.input:
        if isinstance(item, MessageItem):
            role = "system" if item.role == "developer" else item.role
            messages.append(ChatMessage(role=role, content=_joined(item.content)))
        elif isinstance(item, FunctionCallItem):
            function_names[item.call_id] = item.name
            function = {"name": item.name, "arguments": item.arguments}
            call = {"id": item.call_id, "type": "function", "function": function}
            last = messages[-1] if messages else None
            if last is not None and last.role == "assistant":
                last.tool_calls = [*(getattr(last, "tool_calls", None) or []), call]
            else:
                messages.append(ChatMessage(role="assistant", content="", tool_calls=[call]))
        else:
            messages.append(_tool_message(item, function_names))
    if not messages:
        raise OpenAIError("input holds no items", param="input")
    return messages


def _tool_message(item: FunctionCallOutputItem, function_names: dict[str, str]) -> ChatMessage:
    return ChatMessage(
        role="tool",
        content=item.output,
        tool_call_id=item.call_id,
        name=function_names.get(item.call_id),
    )


def _joined(content: str | list[Any]) -> str:
    return content if isinstance(content, str) else "".join(part.text for part in content)


def _chat_tool(tool: FunctionTool) -> dict[str, Any]:
    function: dict[str, Any] = {"name": tool.name}
    if tool.parameters is not None:
        function["parameters"] = tool.parameters
    if tool.description is not None:
        function["description"] = tool.description
    return {"type": "function", "function": function}


def _chat_tool_choice(choice: str | FunctionToolChoice | None) -> Any:
    if isinstance(choice, FunctionToolChoice):
        return {"type": "function", "function": {"name": choice.name}}
    return choice


def responses_tools(request: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The chat request's tools in the Responses API's flat shape (echoed in a response)."""
    tools = []
    for tool in request.tools or []:
        function = tool.function
        tools.append(
            {
                "type": "function",
                "name": function.name,
                "description": function.description,
                "parameters": function.parameters,
                "strict": None,
            }
        )
    return tools


def responses_tool_choice(request: ChatCompletionRequest) -> Any:
    """The chat request's ``tool_choice`` in the Responses API's shape (echoed)."""
    choice = request.tool_choice
    if choice is None:
        return "auto" if request.tools else "none"
    if isinstance(choice, str):
        return choice
    return {"type": "function", "name": choice.function.name}
