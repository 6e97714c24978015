"""Reasoning parsers: the plugin kind that tells a model's reasoning from its answer.

Thinking models (Qwen3, the DeepSeek-R1 distills, SmolLM3 with ``/think``) write their
reasoning first, between ``<think>`` and ``</think>``, then the answer. The server builds
one :class:`ReasoningParser` per reply and feeds it the text as it is generated; the parser
answers with :data:`ReasoningParserEvent` values: :class:`ReasoningDelta` (the client sees
it as ``reasoning_content``) and :class:`AnswerDelta` (``content``, and the only text a
tool-call parser reads).

Streaming is the only way a parser is written: :meth:`ReasoningParser.parse` of a whole
text is ``feed(text)`` then ``finish()``, joined by :func:`join_reasoning_events`, so a
streamed reply and a whole one cannot disagree. All of a reply's reasoning comes before
its answer: once a parser gave an answer delta it gives no reasoning delta, so a client
sees ``delta.reasoning_content`` chunks, then ``delta.content`` ones. A parser never raises
on what the model wrote.

A parser whose format is two marker strings declares them as :class:`ReasoningMarkers`
(``ReasoningParser.markers``); then an output constraint (``response_format``, a forced
tool call) can apply to the answer alone: the engine lets the reasoning run free and
starts the grammar after the end marker
(:mod:`vlite.core.reasoning_grammar`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from dataclasses import dataclass
from typing import ClassVar


@dataclass(frozen=True)
class ReasoningDelta:
    """Text of the reply's reasoning (markers removed)."""

    text: str


@dataclass(frozen=True)
class AnswerDelta:
    """Text of the reply's answer: what follows the reasoning."""

    text: str


ReasoningParserEvent = ReasoningDelta | AnswerDelta


@dataclass(frozen=True)
class ReasoningMarkers:
    """Where a reply's reasoning is, given by two markers (``<think>`` and ``</think>``).

    A reply that opens with ``start`` (after whitespace, dropped with it) reasons from
    there to the first ``end``; any other reply reasons from its first character to the
    first ``end`` when ``starts_in_reasoning`` (templates that end the prompt with
    ``start``), and has no reasoning otherwise. The answer is all that follows that
    ``end``; a reply whose reasoning never ends is all reasoning. Both markers are
    non-empty, and ``end`` does not occur in ``start``.
    """

    start: str
    end: str
    starts_in_reasoning: bool = False

    def __post_init__(self) -> None:
        if not (isinstance(self.start, str) and isinstance(self.end, str)):
            raise TypeError(f"markers must be strings: {self.start!r}, {self.end!r}")
        if not self.start or not self.end or self.end in self.start:
            raise ValueError(
                f"ReasoningMarkers({self.start!r}, {self.end!r}) is invalid: both markers must "
                "be non-empty, and the end marker must not occur in the start marker"
            )

    def split(self, text: str) -> ReasoningParseResult:
        """A whole reply's reasoning and answer as these markers define them (what a
        parser declaring them must give; ``ReasoningParserConformance`` checks it)."""
        opened = text.lstrip()
        if opened.startswith(self.start):
            body = opened[len(self.start) :]
        elif self.starts_in_reasoning:
            body = text
        else:
            return ReasoningParseResult("", text)
        end = body.find(self.end)
        if end < 0:
            return ReasoningParseResult(body, "")
        return ReasoningParseResult(body[:end], body[end + len(self.end) :])


@dataclass(frozen=True)
class ReasoningParseResult:
    """A whole reply, split: its reasoning and its answer (each the deltas joined; ``""``
    when there is none)."""

    reasoning: str
    answer: str


@dataclass(frozen=True)
class ReasoningParserExample:
    """A model output and how a parser must split it (the conformance suite's golden
    outputs; a parser class lists its own in ``examples``)."""

    text: str
    reasoning: str
    answer: str


def join_reasoning_events(events: Iterable[ReasoningParserEvent]) -> ReasoningParseResult:
    """The reply a sequence of events makes: reasoning deltas joined, answer deltas joined."""
    reasoning: list[str] = []
    answer: list[str] = []
    for event in events:
        (reasoning if isinstance(event, ReasoningDelta) else answer).append(event.text)
    return ReasoningParseResult("".join(reasoning), "".join(answer))


class ReasoningParser(ABC):
    """Splits one reply into reasoning and answer as the text arrives. Registered with
    ``register_reasoning_parsers`` and constructed once per reply (per choice) as
    ``cls()``.

    Use an instance once: :meth:`feed` each delta of the text, then :meth:`finish`; or
    :meth:`parse` a whole text. Neither may raise on anything the model wrote.

    Attributes:
        examples: golden outputs of this format, which ``ReasoningParserConformance``
            checks when the test class sets none.
        markers: the format's :class:`ReasoningMarkers`, when it is two markers that split
            every reply as that class says (``ReasoningParserConformance`` checks the
            parser against them); ``None`` (the default): an output constraint cannot
            start after this parser's reasoning, and the server refuses one.
    """

    examples: ClassVar[tuple[ReasoningParserExample, ...]] = ()
    markers: ClassVar[ReasoningMarkers | None] = None

    @abstractmethod
    def feed(self, delta_text: str) -> list[ReasoningParserEvent]:
        """The events the text so far settles, given its next ``delta_text``. Text that
        could still be part of a marker is held back for later."""

    @abstractmethod
    def finish(self) -> list[ReasoningParserEvent]:
        """The events of the text held back, once the reply has ended."""

    def parse(self, text: str) -> ReasoningParseResult:
        """A whole reply, split through the streaming path (``feed`` then ``finish``)."""
        return join_reasoning_events([*self.feed(text), *self.finish()])
