"""``mistral``: Mistral's tool calls, ``[TOOL_CALLS]`` then a JSON list of ``{"name": ...,
"arguments": {...}}``, which runs to the end of the output; content may come before."""

from __future__ import annotations

import json
from typing import ClassVar

from vlite.core.tool_parser import (
    ContentDelta,
    ToolParser,
    ToolParserEvent,
    ToolParserExample,
    partial_marker_length,
)

MARKER = "[TOOL_CALLS]"


class MistralToolParser(ToolParser):
    """Streams content up to ``[TOOL_CALLS]`` (holding back a suffix that could begin it),
    then holds the rest to the end and reads it as a JSON list of calls: if it does not
    read (bad JSON, text after the list, an unknown function), it is content, marker and
    all."""

    template_markers: ClassVar[tuple[str, ...]] = (MARKER,)
    examples: ClassVar[tuple[ToolParserExample, ...]] = (
        ToolParserExample(
            '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]',
            "",
            (("get_weather", {"city": "Paris"}),),
        ),
        ToolParserExample(
            'Checking [both]. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": '
            '"[Oslo]"}}, {"name": "get_time", "arguments": {}}]\n',
            "Checking [both]. ",
            (("get_weather", {"city": "[Oslo]"}), ("get_time", {})),
        ),
        ToolParserExample("A [TOOL_CALL without the marker [TOOL_"),
        ToolParserExample('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Pa'),
        ToolParserExample('[TOOL_CALLS][{"name": "get_weather", "arguments": {}}] more text'),
        ToolParserExample('[TOOL_CALLS]{"name": "get_weather", "arguments": {}}'),
        ToolParserExample("[TOOL_CALLS][]"),
    )

    def __init__(self, tools) -> None:
        super().__init__(tools)
        self._held = ""
        self._in_calls = False

    def feed(self, delta_text: str) -> list[ToolParserEvent]:
        self._held += delta_text
        if self._in_calls:
            return []
        start = self._held.find(MARKER)
        if start >= 0:
            content, self._held = self._held[:start], self._held[start + len(MARKER) :]
            self._in_calls = True
        else:
            cut = len(self._held) - partial_marker_length(self._held, (MARKER,))
            content, self._held = self._held[:cut], self._held[cut:]
        return [ContentDelta(content)] if content else []

    def finish(self) -> list[ToolParserEvent]:
        text, in_calls = self._held, self._in_calls
        self._held, self._in_calls = "", False
        calls = self._read_calls(text) if in_calls else None
        if calls is not None:
            return [event for name, args in calls for event in self.call_events(name, args)]
        text = (MARKER if in_calls else "") + text
        return [ContentDelta(text)] if text else []

    def _read_calls(self, text: str) -> list[tuple[str, dict]] | None:
        """The calls of the list after the marker, or ``None``."""
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            return None
        if not isinstance(value, list) or not value:
            return None
        calls = []
        for item in value:
            if not isinstance(item, dict):
                return None
            name, arguments = item.get("name"), item.get("arguments", item.get("parameters"))
            if not self.is_known_call(name, arguments):
                return None
            calls.append((name, arguments))
        return calls
