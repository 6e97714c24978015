"""``tool_choice="auto"``: the configured tool-call parser reads a reply's calls, and this
module turns its events into OpenAI's message and stream deltas.

Whitespace is the one thing shaped here, the same way streamed or not (the whole reply is
fed through the same :class:`ToolCallStream`): content's trailing whitespace is held until
more content follows, and dropped where a call follows or the reply ends with calls, so
the newlines a model writes around its calls do not become content.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from vlite.core.plugins import PluginRegistry
from vlite.core.tool_parser import (
    ArgumentsDelta,
    ContentDelta,
    ToolCallStart,
    ToolParser,
    ToolParserEvent,
)
from vlite.server.flag_plugins import plugin_named_by_flag
from vlite.server.protocol import (
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
)

#: The ``vlite serve`` flag that names the parser.
FLAG = "--tool-call-parser"


def tool_parser_class(name: str, registry: PluginRegistry | None = None) -> type[ToolParser]:
    """The tool parser registered as ``name`` (see :func:`plugin_named_by_flag`)."""
    return plugin_named_by_flag("tool_parser", FLAG, name, registry)


@dataclass
class ParsedReply:
    """A whole reply as ``message`` takes it: content (``None`` when only calls) and calls."""

    content: str | None
    tool_calls: list[ToolCall] | None


@dataclass
class ToolCallStream:
    """One choice's parser, with the whitespace held between its events."""

    parser: ToolParser
    num_calls: int = 0
    _space: str = ""
    _arguments: dict[int, list[str]] = field(default_factory=dict)
    _starts: dict[int, ToolCallStart] = field(default_factory=dict)
    _content: list[str] = field(default_factory=list)

    def feed(self, text: str) -> list[DeltaMessage]:
        """The deltas ``text`` (the reply's next text) settles."""
        return self._deltas(self.parser.feed(text))

    def finish(self) -> list[DeltaMessage]:
        """The deltas of what the parser held, at the reply's end."""
        deltas = self._deltas(self.parser.finish())
        if self._space and not self.num_calls:
            deltas.append(self._content_delta(self._space))
        self._space = ""
        return deltas

    def whole(self, text: str) -> ParsedReply:
        """A whole reply, through the same path as a stream."""
        self.feed(text)
        self.finish()
        calls = [
            ToolCall(
                id=start.id,
                function=FunctionCall(name=start.name, arguments="".join(self._arguments[index])),
            )
            for index, start in sorted(self._starts.items())
        ]
        content = "".join(self._content)
        return ParsedReply(content if content or not calls else None, calls or None)

    def _deltas(self, events: Sequence[ToolParserEvent]) -> list[DeltaMessage]:
        deltas = []
        for event in events:
            delta = self._delta(event)
            if delta is not None:
                deltas.append(delta)
        return deltas

    def _delta(self, event: ToolParserEvent) -> DeltaMessage | None:
        if isinstance(event, ContentDelta):
            text = self._space + event.text
            settled = text.rstrip()
            self._space = text[len(settled) :]
            return self._content_delta(settled) if settled else None
        if isinstance(event, ToolCallStart):
            self._space = ""
            self.num_calls += 1
            self._starts[event.index] = event
            self._arguments[event.index] = []
            function = DeltaFunctionCall(name=event.name, arguments="")
            call = DeltaToolCall(index=event.index, id=event.id, type="function", function=function)
            return DeltaMessage(tool_calls=[call])
        assert isinstance(event, ArgumentsDelta)
        self._arguments.setdefault(event.index, []).append(event.text)
        function = DeltaFunctionCall(arguments=event.text)
        return DeltaMessage(tool_calls=[DeltaToolCall(index=event.index, function=function)])

    def _content_delta(self, text: str) -> DeltaMessage:
        self._content.append(text)
        return DeltaMessage(content=text)


def new_stream(parser_cls: type[ToolParser], tools: list[dict[str, Any]]) -> ToolCallStream:
    """A stream for one choice of a reply to a request with ``tools``."""
    return ToolCallStream(parser_cls(tools))
