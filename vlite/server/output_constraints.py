"""A request's output constraints, from OpenAI's and vLLM's request fields.

- ``response_format``: ``{"type": "json_object"}`` or ``{"type": "json_schema",
  "json_schema": {"name": ..., "schema": {...}}}`` (``"text"``: none);
- vLLM's extra-body ``structured_outputs``: ``{"json" | "json_object" | "regex" | "choice" |
  "grammar": ..., "backend": ...}``;
- ``logit_bias`` (OpenAI's shape: token ids as strings);
- chat ``tools`` with ``tool_choice``: ``"required"`` constrains the output to a JSON list
  of calls ``[{"name": ..., "parameters": {...}}]`` of the given functions (one call when
  ``parallel_tool_calls`` is false), a named function to that function's argument schema;
  the reply's ``message.tool_calls`` is parsed back from that text. ``"auto"`` (the
  default with tools) leaves the output free and needs the server's tool-call parser
  (``vlite serve --tool-call-parser``, see :mod:`vlite.server.tool_calls`) to tell a call
  from prose; without one it is a 400 naming the flag and the choices that work.
  ``"none"`` ignores the tools.

At most one constraint per request: two (say ``response_format`` and a forced tool call)
are a 400 naming both.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from vlite.core.structured_output_params import StructuredOutputsError, StructuredOutputsParams
from vlite.server.errors import OpenAIError
from vlite.server.protocol import (
    ChatCompletionRequest,
    ChatTool,
    FunctionCall,
    NamedToolChoice,
    SamplingRequest,
    ToolCall,
)


def request_constraint(request: SamplingRequest) -> StructuredOutputsParams | None:
    """The constraint of ``response_format`` or ``structured_outputs`` (``None`` for none).

    Raises:
        OpenAIError: both are set, or either is invalid (naming the field).
    """
    from_format = _response_format_constraint(request)
    if request.structured_outputs is None:
        return from_format
    if from_format is not None:
        raise OpenAIError(
            "response_format and structured_outputs both constrain the output; send one",
            param="structured_outputs",
        )
    try:
        return StructuredOutputsParams(**request.structured_outputs)
    except StructuredOutputsError as exc:
        raise OpenAIError(str(exc), param=exc.param) from None
    except TypeError as exc:  # an unknown key
        raise OpenAIError(
            f"structured_outputs has an unknown field ({exc}); the fields are json, "
            "json_object, regex, choice, grammar and backend",
            param="structured_outputs",
        ) from None


def _response_format_constraint(request: SamplingRequest) -> StructuredOutputsParams | None:
    response_format = request.response_format
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return StructuredOutputsParams(json_object=True)
    if response_format.json_schema is None:
        raise OpenAIError(
            "response_format of type 'json_schema' needs a json_schema object with a schema",
            param="response_format.json_schema",
        )
    try:
        return StructuredOutputsParams(json=response_format.json_schema.json_schema)
    except StructuredOutputsError as exc:
        raise OpenAIError(str(exc), param="response_format.json_schema") from None


def logit_bias_of(request: SamplingRequest) -> dict[int, float] | None:
    """``logit_bias`` with integer token ids (OpenAI sends them as strings).

    Raises:
        OpenAIError: a key that is not a token id.
    """
    if not request.logit_bias:
        return None
    bias = {}
    for key, value in request.logit_bias.items():
        try:
            token_id = int(key)
        except ValueError:
            token_id = -1
        if token_id < 0 or str(token_id) != key.strip():
            raise OpenAIError(
                f"logit_bias has the key {key!r}: keys must be token ids (integers >= 0)",
                param="logit_bias",
            )
        bias[token_id] = value
    return bias


# ---- tools ------------------------------------------------------------------------------


@dataclass
class ToolPlan:
    """How a chat request's tools shape its output and its reply.

    Attributes:
        mode: ``"none"`` (plain text), ``"required"`` (a JSON list of calls), ``"named"``
            (the arguments of ``function_name``) or ``"auto"`` (free text, whose calls the
            server's tool-call parser reads).
        constraint: the output's constraint (``None`` in mode ``"none"``).
        tools: the tools as the chat template takes them (``None`` in mode ``"none"``).
    """

    mode: str = "none"
    function_name: str | None = None
    constraint: StructuredOutputsParams | None = None
    tools: list[dict[str, Any]] | None = field(default=None)

    @property
    def calls_tools(self) -> bool:
        """Whether the output is constrained to calls (``"required"``, ``"named"``)."""
        return self.mode in ("required", "named")

    @property
    def parses_calls(self) -> bool:
        """Whether the server's tool-call parser reads the calls (``"auto"``)."""
        return self.mode == "auto"

    def tool_calls(self, text: str) -> list[ToolCall] | None:
        """The calls in an output that followed the constraint; ``None`` if ``text`` does
        not parse (an output cut short by ``max_tokens``)."""
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            return None
        if self.mode == "named":
            return [_call(self.function_name, value)]
        if not isinstance(value, list) or not all(isinstance(item, dict) for item in value):
            return None
        return [_call(item.get("name", ""), item.get("parameters", {})) for item in value]


def _call(name: str, arguments: Any) -> ToolCall:
    return ToolCall(
        function=FunctionCall(name=name, arguments=json.dumps(arguments, ensure_ascii=False))
    )


def tool_plan(request: ChatCompletionRequest, has_parser: bool = False) -> ToolPlan:
    """What the request's ``tools`` and ``tool_choice`` ask for (``has_parser``: whether
    the server has a tool-call parser, which ``"auto"`` needs).

    Raises:
        OpenAIError: ``tool_choice`` without tools, ``"auto"`` (the default with tools)
            without a parser, a named function that is not among the tools.
    """
    choice, tools = request.tool_choice, request.tools or []
    if choice not in (None, "none") and not tools:
        raise OpenAIError("tool_choice needs tools", param="tool_choice")
    if not tools or choice == "none":
        return ToolPlan()
    tools_shown = template_tools(tools)
    if choice in (None, "auto"):
        if has_parser:
            return ToolPlan("auto", tools=tools_shown)
        raise OpenAIError(
            "tool_choice 'auto' (the default when tools are given) needs a tool-call parser "
            "to tell a call from text, and this server has none: none was named (start it "
            "with --tool-call-parser NAME) and none could be chosen from the model's chat "
            "template; or use tool_choice 'required', name a function, or 'none'",
            param="tool_choice",
        )
    if isinstance(choice, NamedToolChoice):
        by_name = {tool.function.name: tool.function for tool in tools}
        function = by_name.get(choice.function.name)
        if function is None:
            raise OpenAIError(
                f"tool_choice names the function {choice.function.name!r}, which is not among "
                f"the tools ({', '.join(by_name)})",
                param="tool_choice",
            )
        constraint = _constraint(function.parameters, "tools")
        return ToolPlan("named", function.name, constraint, tools_shown)
    schema = _calls_schema(tools, one_call=not request.parallel_tool_calls)
    return ToolPlan("required", None, _constraint(schema, "tools"), tools_shown)


def template_tools(tools: list[ChatTool]) -> list[dict[str, Any]]:
    """The tools as the chat template takes them (``/tokenize`` shows them the same way)."""
    return [tool.model_dump(exclude_none=True) for tool in tools]


def _constraint(schema: dict[str, Any], param: str) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(json=schema)
    except StructuredOutputsError as exc:
        raise OpenAIError(str(exc), param=param) from None


def _calls_schema(tools: list, one_call: bool) -> dict[str, Any]:
    """A JSON list of ``{"name": one of the tools, "parameters": its arguments}``."""
    options = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [tool.function.name]},
                "parameters": tool.function.parameters,
            },
            "required": ["name", "parameters"],
        }
        for tool in tools
    ]
    items = options[0] if len(options) == 1 else {"anyOf": options}
    schema: dict[str, Any] = {"type": "array", "items": items, "minItems": 1}
    if one_call:
        schema["maxItems"] = 1
    return schema
