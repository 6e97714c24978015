"""``tool_choice="auto"``: the configured tool-call parser reads a reply's calls, and this
module turns its events into OpenAI's message and stream deltas.

Whitespace is the one thing shaped here, the same way streamed or not (the whole reply is
fed through the same :class:`ToolCallStream`): content's trailing whitespace is held until
more content follows, and dropped where a call follows or the reply ends with calls, so
the newlines a model writes around its calls do not become content.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vlite.core.plugins import PluginRegistry, build_plugin_manager
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

if TYPE_CHECKING:
    from vlite.server.settings import ServerSettings

logger = logging.getLogger(__name__)

#: The ``vlite serve`` flag that names the parser.
FLAG = "--tool-call-parser"
#: ``--tool-call-parser none``: no parser, not even one chosen from the chat template.
NO_PARSER = "none"


def tool_parser_class(name: str, registry: PluginRegistry | None = None) -> type[ToolParser]:
    """The tool parser registered as ``name`` (see :func:`plugin_named_by_flag`)."""
    return plugin_named_by_flag("tool_parser", FLAG, name, registry)


def parser_from_template(template: Any, registry: PluginRegistry | None = None) -> str | None:
    """The name of the registered tool parser whose format ``template`` (a chat template:
    a string, or a tokenizer's named templates as a mapping, all of them read) writes:
    the one parser all of whose :attr:`~vlite.core.tool_parser.ToolParser.template_markers`
    it contains. ``None`` when no parser has them all, or several do (ambiguous), or there
    is no template; a parser without markers is never chosen.
    """
    if isinstance(template, Mapping):
        template = "\n".join(str(text) for text in template.values())
    if not isinstance(template, str) or not template:
        return None
    registry = registry or PluginRegistry(build_plugin_manager())
    matches = []
    for name in registry.names("tool_parser"):
        markers = getattr(registry.get("tool_parser", name), "template_markers", ())
        if markers and all(marker in template for marker in markers):
            matches.append(name)
    return matches[0] if len(matches) == 1 else None


def with_template_tool_parser(settings: ServerSettings, tokenizer: Any) -> ServerSettings:
    """``settings`` with the tool-call parser chosen from ``tokenizer``'s chat template
    (:func:`parser_from_template`), logged, when none was named; as they are when one was
    (``none`` included) or none can be chosen."""
    if settings.tool_call_parser is not None:
        return settings
    name = parser_from_template(getattr(tokenizer, "chat_template", None))
    if name is None:
        return settings
    logger.info(chosen_message(name))
    return settings.model_copy(update={"tool_call_parser": name})


def chosen_message(name: str) -> str:
    """The line that says a parser was chosen from the chat template."""
    return f"tool-call parser {name!r} chosen from the chat template; {FLAG} overrides"


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
