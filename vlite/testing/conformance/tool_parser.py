"""ToolParserConformance: a tool-call parser reads its format's golden outputs, and gives
the same reply however the text is cut into deltas.

The golden outputs (:class:`~vlite.core.tool_parser.ToolParserExample`: a model's text, the
content and calls it must give) come from the test class's ``examples``, else the parser
class's own. Each is parsed whole and must give exactly its content and calls; then it is
streamed whole, character by character, in two deltas at every split point and in seeded
random chunkings, and every stream's events must join to the whole parse. Every prefix of
every example (an output cut off by ``max_tokens``) is streamed the same ways without an
error, and every example read by a parser whose request offered no tools is content.
"""

from __future__ import annotations

import inspect
import json
import random
import re
from collections.abc import Iterator, Sequence
from typing import Any, ClassVar

import pytest

from vlite.core.tool_parser import (
    ArgumentsDelta,
    ContentDelta,
    ToolCallStart,
    ToolParser,
    ToolParseResult,
    ToolParserExample,
    join_events,
)
from vlite.testing.conformance.base import PluginConformance

#: OpenAI's call ids: ``call_`` and letters, digits, ``_`` or ``-``.
CALL_ID = re.compile(r"call_[A-Za-z0-9_-]{8,}")


def tools_for(examples: Sequence[ToolParserExample]) -> list[dict[str, Any]]:
    """OpenAI-shaped tools: one per function the examples call."""
    names = sorted({name for example in examples for name, _ in example.calls})
    return [
        {"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}
        for name in names
    ]


def comparable(result: ToolParseResult) -> tuple[str, list[tuple[str, Any]]]:
    """A reply without its random call ids: content, and each call's name and arguments
    as the JSON value (or the text, if it is not JSON)."""
    calls = []
    for call in result.calls:
        try:
            arguments = json.loads(call.arguments)
        except json.JSONDecodeError:
            arguments = call.arguments
        calls.append((call.name, arguments))
    return result.content, calls


def golden_examples(suite: type, plugin_cls: Any, example_type: type) -> list[Any]:
    """A parser suite's golden outputs: the test class's ``examples``, else the parser
    class's own; there must be some."""
    examples = list(suite.examples if suite.examples is not None else plugin_cls.examples)
    assert examples, (
        f"{suite.__name__} has no examples: set examples, or the parser's class attribute "
        f"examples, to golden outputs ({example_type.__name__})"
    )
    return examples


def chunkings(
    text: str, seed: int, num_random: int, every_split: bool = True
) -> Iterator[tuple[str, list[str]]]:
    """(name, deltas) of the ways the suite cuts ``text``: whole, one character at a
    time, two deltas at every split point (if ``every_split``), and ``num_random`` seeded
    random chunkings."""
    yield "whole", [text]
    yield "by-character", list(text)
    for split in range(1, len(text) if every_split else 0):
        yield f"split-at-{split}", [text[:split], text[split:]]
    if len(text) < 2:
        return
    rng = random.Random(seed)
    for attempt in range(num_random):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 8))))
        bounds = [0, *cuts, len(text)]
        yield f"random-{attempt}", [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


class ToolParserConformance(PluginConformance):
    """Conformance suite for ``register_tool_parsers`` plugins.

    Attributes:
        examples: golden outputs (``ToolParserExample``): a model's text, and the content
            and calls it gives; an example without ``content`` and ``calls`` is one the
            parser must give back as content (bad JSON, a call cut off, prose). Default:
            the parser class's own ``examples``. At least one must hold a call, and one
            must not.
        num_random_chunkings: random chunkings of each text (seeded by ``seed``).
    """

    plugin_kind = "tool_parser"
    examples: ClassVar[Sequence[ToolParserExample] | None] = None
    num_random_chunkings: ClassVar[int] = 20
    seed: ClassVar[int] = 0

    def check_interface(self, plugin_cls: Any) -> None:
        assert inspect.isclass(plugin_cls) and issubclass(plugin_cls, ToolParser)
        assert not inspect.isabstract(plugin_cls), f"{plugin_cls!r} leaves feed/finish abstract"

    @pytest.fixture(scope="class")
    @classmethod
    def golden(cls, plugin_cls) -> list[ToolParserExample]:
        return golden_examples(cls, plugin_cls, ToolParserExample)

    @pytest.fixture(scope="class")
    @classmethod
    def tools(cls, golden) -> list[dict[str, Any]]:
        return tools_for(golden)

    # ---- running the parser ----------------------------------------------------------

    def stream(self, plugin_cls: Any, tools: list, deltas: Sequence[str]) -> ToolParseResult:
        """The reply a fresh parser streams for ``deltas``, its events checked for form."""
        parser = plugin_cls(tools)
        events = []
        for delta in deltas:
            produced = parser.feed(delta)
            assert isinstance(produced, list), f"feed() returned {type(produced).__name__}"
            events.extend(produced)
        produced = parser.finish()
        assert isinstance(produced, list), f"finish() returned {type(produced).__name__}"
        events.extend(produced)
        self.check_events(events)
        return join_events(events)

    def check_events(self, events: list) -> None:
        """Content deltas are non-empty strings; calls start in order 0, 1, ... with an id
        like OpenAI's, each id once; argument fragments belong to a started call."""
        started: list[ToolCallStart] = []
        for event in events:
            assert isinstance(event, ContentDelta | ToolCallStart | ArgumentsDelta), event
            if isinstance(event, ContentDelta):
                assert isinstance(event.text, str) and event.text, f"empty content: {event!r}"
            elif isinstance(event, ToolCallStart):
                assert event.index == len(started), f"call {event.index} after {len(started)}"
                assert CALL_ID.fullmatch(event.id), f"call id {event.id!r} is not call_..."
                started.append(event)
            else:
                assert 0 <= event.index < len(started), f"arguments of no call: {event!r}"
        ids = [start.id for start in started]
        assert len(set(ids)) == len(ids), f"call ids repeat: {ids}"

    def check_streams_as_parsed(
        self, plugin_cls: Any, tools: list, text: str, num_random: int, every_split: bool
    ) -> None:
        """Every chunking of ``text`` streams to what ``parse(text)`` gives."""
        whole = comparable(plugin_cls(tools).parse(text))
        for name, deltas in chunkings(text, self.seed, num_random, every_split):
            streamed = comparable(self.stream(plugin_cls, tools, deltas))
            assert streamed == whole, (
                f"{text!r} streamed {name} ({deltas[:6]}...) gives {streamed}, parsed whole {whole}"
            )

    # ---- golden outputs ----------------------------------------------------------------

    def test_examples_include_calls_and_content(self, golden) -> None:
        assert any(example.calls for example in golden), "no example holds a call"
        assert any(not example.calls for example in golden), "no example is content only"

    def test_examples_parse_to_their_content_and_calls(self, plugin_cls, tools, golden):
        for example in golden:
            result = comparable(plugin_cls(tools).parse(example.text))
            expected = (
                example.expected_content,
                [(name, json.loads(json.dumps(dict(args)))) for name, args in example.calls],
            )
            assert result == expected, f"{example.text!r} parses to {result}, not {expected}"

    def test_arguments_are_json_objects(self, plugin_cls, tools, golden) -> None:
        for example in golden:
            for call in plugin_cls(tools).parse(example.text).calls:
                assert isinstance(json.loads(call.arguments), dict), call

    # ---- streaming ---------------------------------------------------------------------

    def test_examples_stream_as_they_parse_however_cut(self, plugin_cls, tools, golden):
        """Whole, by character, at every split point, in random chunkings: the streamed
        events join to the whole parse (a marker split across deltas never leaks)."""
        for example in golden:
            self.check_streams_as_parsed(
                plugin_cls, tools, example.text, self.num_random_chunkings, every_split=True
            )

    def test_cut_off_outputs_stream_as_they_parse(self, plugin_cls, tools, golden):
        """Every prefix of every example (``max_tokens`` may end a reply anywhere) is read
        without an error and streams (whole, by character, in three random chunkings) as
        it parses."""
        for example in golden:
            for end in range(len(example.text)):
                prefix = example.text[:end]
                self.check_streams_as_parsed(plugin_cls, tools, prefix, 3, every_split=False)

    def test_calls_of_functions_not_offered_are_content(self, plugin_cls, golden) -> None:
        """With no tools in the request every example is content, exactly its text."""
        for example in golden:
            result = self.stream(plugin_cls, [], [example.text])
            assert comparable(result) == (example.text, []), (
                f"{example.text!r} with no tools gives {comparable(result)}"
            )

    def test_an_empty_reply_gives_nothing(self, plugin_cls, tools) -> None:
        parser = plugin_cls(tools)
        assert parser.feed("") == [] and parser.finish() == []
