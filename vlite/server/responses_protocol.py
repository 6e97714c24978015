"""OpenAI's Responses API bodies (pydantic): what ``POST /v1/responses`` accepts and sends.

vlite keeps no state, so only a stateless request is accepted: ``store`` must be false or
absent and ``previous_response_id`` is refused. The models forbid unknown fields and the
input items are a closed set (messages of text, ``function_call``,
``function_call_output``), so an image, a reasoning item or a built-in tool is a 400 naming
the field, not silently dropped. ``metadata`` is accepted and ignored.
"""

from __future__ import annotations

import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

from vlite.server.protocol import Int32


def response_id(prefix: str) -> str:
    """An id in the Responses API's spelling: ``resp_...``, ``msg_...``, ``fc_...``."""
    return f"{prefix}_{uuid.uuid4().hex}"


def call_id(chat_id: str | None) -> str:
    """A chat tool call's id (``call-...``) as the Responses API spells one: ``call_...``."""
    if not chat_id:
        return response_id("call")
    return "call_" + chat_id.removeprefix("call-") if chat_id.startswith("call-") else chat_id


class _Strict(BaseModel):
    """Unknown fields are refused: a field vlite does not know it cannot honour."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


# ---- requests ---------------------------------------------------------------------------


class InputText(_Strict):
    """A message's text part (``output_text``: an assistant's, sent back)."""

    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = None  # an earlier output's, accepted, ignored


class MessageItem(_Strict):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputText]
    id: str | None = None
    status: str | None = None


class FunctionCallItem(_Strict):
    """An earlier call of the assistant's."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(_Strict):
    """The result of the call ``call_id``."""

    type: Literal["function_call_output"]
    call_id: str
    output: str
    id: str | None = None
    status: str | None = None


def _item_type(item: Any) -> Any:
    """An item's ``type`` (a message may leave it out)."""
    if isinstance(item, dict):
        return item.get("type", "message")
    return getattr(item, "type", "message")


#: The tag names pydantic puts in a complaint's location (left out of the field named).
ITEM_TAGS = ("message", "function_call", "function_call_output")

InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")],
    Discriminator(_item_type),
]


class FunctionTool(_Strict):
    """A function tool in the Responses API's flat shape (built-in tools are refused)."""

    type: Literal["function"]
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionToolChoice(_Strict):
    type: Literal["function"]
    name: str


class ResponsesRequest(_Strict):
    """``POST /v1/responses``."""

    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: Int32 | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["auto", "required", "none"] | FunctionToolChoice | None = None
    parallel_tool_calls: bool | None = None
    store: bool | None = None  # only false: nothing is stored
    previous_response_id: str | None = None  # refused: nothing is stored
    metadata: dict[str, Any] | None = None  # accepted, ignored


# ---- responses --------------------------------------------------------------------------


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class OutputMessage(BaseModel):
    type: Literal["message"] = "message"
    id: str = Field(default_factory=lambda: response_id("msg"))
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"] = "completed"
    content: list[OutputText]


class OutputFunctionCall(BaseModel):
    type: Literal["function_call"] = "function_call"
    id: str = Field(default_factory=lambda: response_id("fc"))
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponsesUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseObject(BaseModel):
    """The response (whole, or the stream's snapshot in its lifecycle events)."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["completed", "incomplete", "in_progress"]
    incomplete_details: IncompleteDetails | None = None
    error: None = None
    model: str
    output: list[OutputMessage | OutputFunctionCall]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]]
    tool_choice: Any
    parallel_tool_calls: bool
    store: bool = False
    previous_response_id: None = None
    metadata: dict[str, Any] = Field(default_factory=dict)
    usage: ResponsesUsage | None = None
