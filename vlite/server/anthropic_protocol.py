"""Anthropic's Messages API bodies (pydantic): what ``POST /v1/messages`` accepts and sends.

Only what vlite can honour is accepted: the models forbid unknown fields and the content
blocks are a closed set (``text``, ``tool_use``, ``tool_result``), so an image, a thinking
block or a server tool is a 400 naming the field, not silently dropped. ``cache_control``
is accepted and ignored wherever Anthropic allows it: it is a caching hint, not content.
"""

from __future__ import annotations

import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from vlite.server.protocol import Int32


def anthropic_id(prefix: str) -> str:
    """An id in Anthropic's spelling: ``msg_...``, ``toolu_...`` (32 hex digits)."""
    return f"{prefix}_{uuid.uuid4().hex}"


class _Strict(BaseModel):
    """Unknown fields are refused: a field vlite does not know it cannot honour."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


# ---- requests ---------------------------------------------------------------------------


class TextBlock(_Strict):
    type: Literal["text"]
    text: str
    cache_control: dict[str, Any] | None = None  # accepted, ignored


class ToolUseBlock(_Strict):
    """An earlier call of the assistant's."""

    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: dict[str, Any] | None = None  # accepted, ignored


class ToolResultBlock(_Strict):
    """The result of the call ``tool_use_id``, sent back in a user message."""

    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] = ""
    is_error: bool = False
    cache_control: dict[str, Any] | None = None  # accepted, ignored


ContentBlock = Annotated[TextBlock | ToolUseBlock | ToolResultBlock, Field(discriminator="type")]


class InputMessage(_Strict):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]


class Tool(_Strict):
    """A client tool (Anthropic's server tools, with other types, are refused)."""

    type: Literal["custom"] | None = None
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    input_schema: dict[str, Any]
    cache_control: dict[str, Any] | None = None  # accepted, ignored


class ToolChoice(_Strict):
    """``auto`` (the default with tools), ``any`` (some tool), ``tool`` (``name``), ``none``."""

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class MessagesRequest(_Strict):
    """``POST /v1/messages``."""

    model: str
    max_tokens: Int32 = Field(ge=1)
    messages: list[InputMessage] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int32 | None = None
    stream: bool = False
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    metadata: dict[str, Any] | None = None  # accepted, ignored
    cache_control: dict[str, Any] | None = None  # accepted, ignored


# ---- responses --------------------------------------------------------------------------


class ResponseText(BaseModel):
    type: Literal["text"] = "text"
    text: str


class ResponseToolUse(BaseModel):
    type: Literal["tool_use"] = "tool_use"
    id: str = Field(default_factory=lambda: anthropic_id("toolu"))
    name: str
    input: dict[str, Any]


class MessagesUsage(BaseModel):
    input_tokens: int
    output_tokens: int


StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class MessagesResponse(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[ResponseText | ResponseToolUse]
    stop_reason: StopReason | None
    stop_sequence: str | None = None
    usage: MessagesUsage


class AnthropicErrorInfo(BaseModel):
    type: str
    message: str


class AnthropicErrorResponse(BaseModel):
    """Anthropic's error body: ``{"type": "error", "error": {"type", "message"}}``."""

    type: Literal["error"] = "error"
    error: AnthropicErrorInfo
