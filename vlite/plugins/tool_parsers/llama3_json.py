"""``llama3_json``: Llama 3.1+'s JSON tool calls, ``{"name": ..., "parameters": {...}}``
as the whole output, optionally after ``<|python_tag|>``, several separated by ``;``."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, ClassVar

from vlite.core.tool_parser import ToolParserExample
from vlite.plugins.tool_parsers.whole_output import WholeOutputToolParser

PYTHON_TAG = "<|python_tag|>"
_DECODER = json.JSONDecoder()


class Llama3JsonToolParser(WholeOutputToolParser):
    """Reads Llama 3's JSON calls; any other output (prose, one bad object among several,
    text after the last object) is content."""

    openers = ("{", PYTHON_TAG)
    # Llama 3.1/3.2/3.3's templates ask for calls with this sentence (``<|python_tag|>`` is
    # also in them, but it is the built-in tools' marker, not this JSON format's).
    template_markers: ClassVar[tuple[str, ...]] = (
        "Given the following functions, please respond with a JSON for a function call",
    )
    examples: ClassVar[tuple[ToolParserExample, ...]] = (
        ToolParserExample(
            '{"name": "get_weather", "parameters": {"city": "Paris"}}',
            "",
            (("get_weather", {"city": "Paris"}),),
        ),
        ToolParserExample(
            '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo; Norway"}}; '
            '{"name": "get_time", "parameters": {}}',
            "",
            (("get_weather", {"city": "Oslo; Norway"}), ("get_time", {})),
        ),
        ToolParserExample("  \n", "  \n"),
        ToolParserExample("It is sunny in {Paris}.", "It is sunny in {Paris}."),
        ToolParserExample('{"name": "get_weather", "parameters": {"city": "Pa'),
        ToolParserExample('{"name": "get_weather", "parameters": {}} and more'),
        ToolParserExample('{"name": "get_weather", "parameters": []}'),
        ToolParserExample("<|python_tag|>print('hi')"),
        ToolParserExample("<|python"),
    )

    def read_calls(self, text: str) -> list[tuple[Any, Mapping[str, Any]]] | None:
        body = text.strip().removeprefix(PYTHON_TAG)
        calls, position = [], 0
        while True:
            position = _skip_space(body, position)
            try:
                value, position = _DECODER.raw_decode(body, position)
            except json.JSONDecodeError:
                return None
            if not isinstance(value, dict):
                return None
            calls.append((value.get("name"), value.get("parameters", value.get("arguments"))))
            position = _skip_space(body, position)
            if position == len(body):
                return calls
            if body[position] != ";":
                return None
            position += 1


def _skip_space(text: str, position: int) -> int:
    while position < len(text) and text[position].isspace():
        position += 1
    return position
