"""The shared half of parsers whose calls are the whole output (``llama3_json``,
``pythonic``): the output is calls only if it starts with one of the format's openers
(after whitespace) and reads as calls to its end; otherwise all of it is content."""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Mapping
from typing import Any, ClassVar

from vlite.core.tool_parser import ContentDelta, ToolParser, ToolParserEvent

#: The parser has not yet seen the output's first characters that are not whitespace.
UNDECIDED = "undecided"
#: The output is prose: each delta is content as it comes.
CONTENT = "content"
#: The output starts like calls: it is held until the end, where it is read.
CALLS = "calls"


class WholeOutputToolParser(ToolParser):
    """Streams prose as it comes; holds an output that starts like calls to its end
    (whether it is calls depends on its last character), then reads it with
    :meth:`read_calls`."""

    #: What an output of calls starts with, after whitespace.
    openers: ClassVar[tuple[str, ...]] = ()

    def __init__(self, tools) -> None:
        super().__init__(tools)
        self._held = ""
        self._mode = UNDECIDED

    def feed(self, delta_text: str) -> list[ToolParserEvent]:
        if self._mode == CONTENT:
            return [ContentDelta(delta_text)] if delta_text else []
        self._held += delta_text
        if self._mode == CALLS:
            return []
        self._mode = self._mode_of(self._held.lstrip())
        if self._mode == CONTENT:
            text, self._held = self._held, ""
            return [ContentDelta(text)]
        return []

    def _mode_of(self, start: str) -> str:
        """What an output beginning with ``start`` (whitespace stripped) is, so far."""
        if not start or any(opener.startswith(start) for opener in self.openers):
            return UNDECIDED
        if any(start.startswith(opener) for opener in self.openers):
            return CALLS
        return CONTENT

    def finish(self) -> list[ToolParserEvent]:
        text, self._held = self._held, ""
        if not text:
            return []
        calls = self.read_calls(text) if self._mode == CALLS else None
        if not calls or not all(self.is_known_call(name, args) for name, args in calls):
            return [ContentDelta(text)]
        return [event for name, args in calls for event in self.call_events(name, args)]

    @abstractmethod
    def read_calls(self, text: str) -> list[tuple[Any, Mapping[str, Any]]] | None:
        """``(name, arguments)`` of each call in a whole output, or ``None`` when it does
        not read as calls of this format (it is then content)."""
