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
    """

    examples: ClassVar[tuple[ReasoningParserExample, ...]] = ()

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
