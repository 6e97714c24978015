"""``hermes``: Hermes' (and Qwen's) tool calls, ``<tool_call>{"name": ..., "arguments":
{...}}</tool_call>``, any number of them, with content before, between and after."""

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

OPEN = "<tool_call>"
CLOSE = "</tool_call>"


class HermesToolParser(ToolParser):
    """Streams content up to each ``<tool_call>`` (holding back a suffix that could begin
    one), then holds the call until its ``</tool_call>`` and reads it: a call that does
    not read (bad JSON, an unknown function, no closing tag by the end) is content, tags
    and all."""

    # Qwen2.5/Qwen3's, Hermes 2 Pro/3's and SmolLM3's templates show calls this way.
    template_markers: ClassVar[tuple[str, ...]] = (OPEN, CLOSE)
    examples: ClassVar[tuple[ToolParserExample, ...]] = (
        ToolParserExample(
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
            "",
            (("get_weather", {"city": "Paris"}),),
        ),
        ToolParserExample(
            'Let me check. <tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}'
            '</tool_call> and <tool_call>{"name": "get_time", "arguments": {"zone": "CET"}}'
            "</tool_call> Done <tool_",
            "Let me check.  and  Done <tool_",
            (("get_weather", {"city": "Oslo"}), ("get_time", {"zone": "CET"})),
        ),
        ToolParserExample("No calls here, only <tool and </tool_call> text."),
        ToolParserExample('<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>'),
        ToolParserExample('<tool_call>{"name": "get_weather", "arguments": {"city": "Pa'),
        ToolParserExample('<tool_call>{"name": "get_weather", "arguments": "Paris"}</tool_call>'),
        ToolParserExample('<tool_call>["get_weather"]</tool_call> after'),
    )

    def __init__(self, tools) -> None:
        super().__init__(tools)
        self._held = ""
        self._in_call = False

    def feed(self, delta_text: str) -> list[ToolParserEvent]:
        self._held += delta_text
        events: list[ToolParserEvent] = []
        while True:
            step = self._call_step() if self._in_call else self._content_step()
            if step is None:
                return events
            events.extend(step)

    def _content_step(self) -> list[ToolParserEvent] | None:
        """Content up to the next ``<tool_call>`` (then inside a call), or the content
        that cannot begin one (``None``: wait for more text)."""
        start = self._held.find(OPEN)
        if start >= 0:
            content, self._held = self._held[:start], self._held[start + len(OPEN) :]
            self._in_call = True
            return _content(content)
        cut = len(self._held) - partial_marker_length(self._held, (OPEN,))
        content, self._held = self._held[:cut], self._held[cut:]
        return _content(content) or None

    def _call_step(self) -> list[ToolParserEvent] | None:
        """A whole call once its ``</tool_call>`` arrived (``None``: not yet)."""
        end = self._held.find(CLOSE)
        if end < 0:
            return None
        body, self._held = self._held[:end], self._held[end + len(CLOSE) :]
        self._in_call = False
        return self._call_or_content(body)

    def _call_or_content(self, body: str) -> list[ToolParserEvent]:
        try:
            value = json.loads(body)
        except json.JSONDecodeError:
            value = None
        if isinstance(value, dict):
            name, arguments = value.get("name"), value.get("arguments", value.get("parameters"))
            if self.is_known_call(name, arguments):
                return self.call_events(name, arguments)
        return [ContentDelta(OPEN + body + CLOSE)]

    def finish(self) -> list[ToolParserEvent]:
        text = (OPEN if self._in_call else "") + self._held
        self._held, self._in_call = "", False
        return _content(text)


def _content(text: str) -> list[ToolParserEvent]:
    return [ContentDelta(text)] if text else []
