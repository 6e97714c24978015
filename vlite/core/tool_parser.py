"""Tool-call parsers: the plugin kind that tells a model's tool calls from its prose.

A chat model asked with ``tools`` (and ``tool_choice="auto"``) writes its calls in its own
format (Hermes' ``<tool_call>{...}</tool_call>``, Llama 3's bare JSON object, ...). The
server builds one :class:`ToolParser` per reply and feeds it the text as it is generated;
the parser answers with :data:`ToolParserEvent` values: content the client sees as text,
the start of a call (its id and function name) and fragments of its arguments.

Streaming is the only way a parser is written: :meth:`ToolParser.parse` of a whole text is
``feed(text)`` then ``finish()``, joined by :func:`join_events`, so a streamed reply and a
whole one cannot disagree. A parser never raises on what the model wrote: a call it cannot
read (bad JSON, a function the request did not offer, a call cut off by ``max_tokens``)
comes back as content, at the latest from :meth:`ToolParser.finish`.
"""

from __future__ import annotations

import json
import secrets
import string
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

#: The characters of a call id after ``call_`` (OpenAI's ids are letters and digits).
_ID_ALPHABET = string.ascii_letters + string.digits
_ID_LENGTH = 24


def new_tool_call_id() -> str:
    """A call id as OpenAI makes them: ``call_`` and 24 random letters and digits."""
    return "call_" + "".join(secrets.choice(_ID_ALPHABET) for _ in range(_ID_LENGTH))


@dataclass(frozen=True)
class ContentDelta:
    """Text the client sees as the reply's content."""

    text: str


@dataclass(frozen=True)
class ToolCallStart:
    """A call begins: the ``index``-th of the reply (0, 1, ...), with its id and function."""

    index: int
    id: str
    name: str


@dataclass(frozen=True)
class ArgumentsDelta:
    """A fragment of call ``index``'s arguments, JSON text; the fragments of a call joined
    are one JSON object."""

    index: int
    text: str


ToolParserEvent = ContentDelta | ToolCallStart | ArgumentsDelta


@dataclass(frozen=True)
class ParsedToolCall:
    """One call of a reply: ``arguments`` is JSON text of an object (OpenAI's shape)."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class ToolParseResult:
    """A whole reply, parsed: its content (every content delta joined) and its calls."""

    content: str
    calls: tuple[ParsedToolCall, ...] = ()


@dataclass(frozen=True)
class ToolParserExample:
    """A model output and what a parser must make of it (the conformance suite's golden
    outputs; a parser class lists its own in ``examples``).

    Attributes:
        text: what the model wrote.
        content: the content it gives; ``None`` (the default): ``text`` itself, for an
            output that is no call (prose, or a call the parser must refuse).
        calls: the calls, in order, as ``(function name, arguments object)``.
    """

    text: str
    content: str | None = None
    calls: tuple[tuple[str, Mapping[str, Any]], ...] = field(default=())

    @property
    def expected_content(self) -> str:
        """The content the parser must give."""
        return self.text if self.content is None else self.content


def join_events(events: Iterable[ToolParserEvent]) -> ToolParseResult:
    """The reply a sequence of events makes: the content deltas joined, and each call with
    its argument fragments joined (in the order the calls started)."""
    content: list[str] = []
    starts: dict[int, ToolCallStart] = {}
    arguments: dict[int, list[str]] = {}
    for event in events:
        if isinstance(event, ContentDelta):
            content.append(event.text)
        elif isinstance(event, ToolCallStart):
            starts[event.index] = event
            arguments.setdefault(event.index, [])
        else:
            arguments.setdefault(event.index, []).append(event.text)
    calls = tuple(
        ParsedToolCall(start.id, start.name, "".join(arguments[index]))
        for index, start in sorted(starts.items())
    )
    return ToolParseResult("".join(content), calls)


def tool_names_of(tools: Sequence[Mapping[str, Any]]) -> frozenset[str]:
    """The function names of OpenAI-shaped tools (``{"type": "function", "function":
    {"name": ...}}``)."""
    return frozenset(
        str(tool["function"]["name"])
        for tool in tools
        if isinstance(tool.get("function"), Mapping) and "name" in tool["function"]
    )


def partial_marker_length(text: str, markers: Iterable[str]) -> int:
    """How many characters at the end of ``text`` could begin one of ``markers``: a parser
    holds them back until the next text says whether a marker follows (so a marker split
    across two deltas never reaches the client as content)."""
    longest = 0
    for marker in markers:
        for length in range(min(len(marker) - 1, len(text)), longest, -1):
            if text.endswith(marker[:length]):
                longest = length
                break
    return longest


class ToolParser(ABC):
    """Reads one reply's tool calls as the text arrives. Registered with
    ``register_tool_parsers`` and constructed once per reply (per choice) as
    ``cls(tools)``, ``tools`` being the request's tools in OpenAI's shape.

    Use an instance once: :meth:`feed` each delta of the text, then :meth:`finish`; or
    :meth:`parse` a whole text. Neither may raise on anything the model wrote.

    Attributes:
        tools: the request's tools, as given.
        tool_names: their function names: a call of any other function is content.
        examples: golden outputs of this format, which ``ToolParserConformance`` checks
            when the test class sets none.
        template_markers: text whose presence in a chat template shows that the template
            writes this format (Hermes': ``<tool_call>`` and ``</tool_call>``). Started
            without ``--tool-call-parser``, the server uses the one registered parser all
            of whose markers its model's chat template contains, if exactly one has them
            all; a parser without markers (the default) is never chosen so. Keep them
            specific to the format: a marker another format's templates also write makes
            the choice ambiguous, and then none is made.
    """

    examples: ClassVar[tuple[ToolParserExample, ...]] = ()
    template_markers: ClassVar[tuple[str, ...]] = ()

    def __init__(self, tools: Sequence[Mapping[str, Any]]) -> None:
        self.tools = list(tools)
        self.tool_names = tool_names_of(self.tools)
        self._num_calls = 0

    @abstractmethod
    def feed(self, delta_text: str) -> list[ToolParserEvent]:
        """The events the text so far settles, given its next ``delta_text``. Text that
        could still turn out to be part of a call is held back for later."""

    @abstractmethod
    def finish(self) -> list[ToolParserEvent]:
        """The events of the text held back, once the reply has ended: an unfinished or
        unreadable call comes back as content."""

    def parse(self, text: str) -> ToolParseResult:
        """A whole reply, parsed through the streaming path (``feed`` then ``finish``)."""
        return join_events([*self.feed(text), *self.finish()])

    # ---- helpers for subclasses ------------------------------------------------------

    def call_events(self, name: str, arguments: Mapping[str, Any]) -> list[ToolParserEvent]:
        """The events of one complete call: its start (a new id) and its arguments."""
        index, self._num_calls = self._num_calls, self._num_calls + 1
        return [
            ToolCallStart(index, new_tool_call_id(), name),
            ArgumentsDelta(index, json.dumps(dict(arguments), ensure_ascii=False)),
        ]

    def is_known_call(self, name: Any, arguments: Any) -> bool:
        """Whether ``name`` is one of the request's functions and ``arguments`` an object."""
        return isinstance(name, str) and name in self.tool_names and isinstance(arguments, dict)
