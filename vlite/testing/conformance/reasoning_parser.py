"""ReasoningParserConformance: a reasoning parser splits its format's golden outputs into
their reasoning and answer, and gives the same split however the text is cut into deltas.

The golden outputs (:class:`~vlite.core.reasoning_parser.ReasoningParserExample`: a model's
text, the reasoning and the answer it must give) come from the test class's ``examples``,
else the parser class's own. Each is parsed whole and must give exactly its reasoning and
answer; then it is streamed whole, character by character, in two deltas at every split
point and in seeded random chunkings, and every stream's events must join to the whole
parse, with all reasoning before any answer and nothing the model did not write. Every
prefix of every example (an output cut off by ``max_tokens``) is streamed the same ways.
A parser that declares :class:`~vlite.core.reasoning_parser.ReasoningMarkers` (``markers``)
must split every example, and every prefix of one, exactly as the markers define.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any, ClassVar

import pytest

from vlite.core.reasoning_parser import (
    AnswerDelta,
    ReasoningDelta,
    ReasoningMarkers,
    ReasoningParser,
    ReasoningParseResult,
    ReasoningParserExample,
    join_reasoning_events,
)
from vlite.testing.conformance.base import PluginConformance
from vlite.testing.conformance.tool_parser import chunkings, golden_examples


class ReasoningParserConformance(PluginConformance):
    """Conformance suite for ``register_reasoning_parsers`` plugins.

    Attributes:
        examples: golden outputs (``ReasoningParserExample(text, reasoning, answer)``).
            Default: the parser class's own ``examples``. At least one must have both
            reasoning and an answer.
        num_random_chunkings: random chunkings of each text (seeded by ``seed``).
    """

    plugin_kind = "reasoning_parser"
    examples: ClassVar[Sequence[ReasoningParserExample] | None] = None
    num_random_chunkings: ClassVar[int] = 20
    seed: ClassVar[int] = 0

    def check_interface(self, plugin_cls: Any) -> None:
        assert inspect.isclass(plugin_cls) and issubclass(plugin_cls, ReasoningParser)
        assert not inspect.isabstract(plugin_cls), f"{plugin_cls!r} leaves feed/finish abstract"

    @pytest.fixture(scope="class")
    @classmethod
    def golden(cls, plugin_cls) -> list[ReasoningParserExample]:
        return golden_examples(cls, plugin_cls, ReasoningParserExample)

    # ---- running the parser ----------------------------------------------------------

    def stream(self, plugin_cls: Any, text: str, deltas: Sequence[str]) -> ReasoningParseResult:
        """The split a fresh parser streams for ``deltas`` (of ``text``), its events
        checked for form."""
        parser = plugin_cls()
        events = []
        for delta in deltas:
            produced = parser.feed(delta)
            assert isinstance(produced, list), f"feed() returned {type(produced).__name__}"
            events.extend(produced)
        produced = parser.finish()
        assert isinstance(produced, list), f"finish() returned {type(produced).__name__}"
        events.extend(produced)
        self.check_events(text, events)
        return join_reasoning_events(events)

    def check_events(self, text: str, events: list) -> None:
        """Every event is a non-empty delta; no reasoning follows an answer delta; the
        deltas' texts occur in ``text`` in order, without overlapping (markers are dropped,
        nothing is invented or repeated)."""
        answered, position = False, 0
        for event in events:
            assert isinstance(event, ReasoningDelta | AnswerDelta), event
            assert isinstance(event.text, str) and event.text, f"empty delta: {event!r}"
            assert not (answered and isinstance(event, ReasoningDelta)), (
                f"reasoning {event.text!r} after the answer began, streaming {text!r}"
            )
            answered = answered or isinstance(event, AnswerDelta)
            found = text.find(event.text, position)
            assert found >= 0, f"{event!r} is not in {text[position:]!r}, what is left of {text!r}"
            position = found + len(event.text)

    def check_streams_as_parsed(
        self, plugin_cls: Any, text: str, num_random: int, every_split: bool
    ) -> None:
        """Every chunking of ``text`` streams to what ``parse(text)`` gives."""
        whole = plugin_cls().parse(text)
        for name, deltas in chunkings(text, self.seed, num_random, every_split):
            streamed = self.stream(plugin_cls, text, deltas)
            assert streamed == whole, (
                f"{text!r} streamed {name} ({deltas[:6]}...) gives {streamed}, parsed whole {whole}"
            )

    # ---- golden outputs ----------------------------------------------------------------

    def test_examples_include_reasoning_and_an_answer(self, golden) -> None:
        assert any(example.reasoning and example.answer for example in golden), (
            "no example has both reasoning and an answer"
        )

    def test_examples_parse_to_their_reasoning_and_answer(self, plugin_cls, golden) -> None:
        for example in golden:
            result = plugin_cls().parse(example.text)
            expected = ReasoningParseResult(example.reasoning, example.answer)
            assert result == expected, f"{example.text!r} parses to {result}, not {expected}"

    # ---- streaming ---------------------------------------------------------------------

    def test_examples_stream_as_they_parse_however_cut(self, plugin_cls, golden) -> None:
        """Whole, by character, at every split point, in random chunkings: the streamed
        events join to the whole parse (a marker split across deltas never leaks), the
        reasoning first."""
        for example in golden:
            self.check_streams_as_parsed(
                plugin_cls, example.text, self.num_random_chunkings, every_split=True
            )

    def test_cut_off_outputs_stream_as_they_parse(self, plugin_cls, golden) -> None:
        """Every prefix of every example (``max_tokens`` may end a reply anywhere) is read
        without an error and streams (whole, by character, in three random chunkings) as
        it parses."""
        for example in golden:
            for end in range(len(example.text)):
                self.check_streams_as_parsed(plugin_cls, example.text[:end], 3, False)

    # ---- markers ------------------------------------------------------------------------

    def test_declared_markers_split_as_the_parser_does(self, plugin_cls, golden) -> None:
        """Structured outputs trust ``markers`` to tell where the answer starts: a parser
        that declares them splits every example and every prefix as they define."""
        markers = plugin_cls.markers
        if markers is None:
            return  # nothing declared, nothing to hold to
        assert isinstance(markers, ReasoningMarkers), (
            f"{plugin_cls.__name__}.markers is {markers!r}, not None or ReasoningMarkers"
        )
        for example in golden:
            for end in range(len(example.text) + 1):
                text = example.text[:end]
                parsed, defined = plugin_cls().parse(text), markers.split(text)
                assert parsed == defined, (
                    f"{text!r}: the parser gives {parsed}, its markers {markers} define {defined}"
                )

    def test_an_empty_reply_gives_nothing(self, plugin_cls) -> None:
        parser = plugin_cls()
        assert parser.feed("") == [] and parser.finish() == []
