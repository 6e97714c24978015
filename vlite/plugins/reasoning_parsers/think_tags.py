"""The parser of a reasoning between two markers, as :class:`ReasoningMarkers` defines it
(``<think>`` and ``</think>`` unless a subclass sets others): the shared half of
``deepseek_r1`` and ``qwen3``, which differ only in what an output that does not open
with ``<think>`` is (``starts_in_reasoning``)."""

from __future__ import annotations

from typing import ClassVar

from vlite.core.reasoning_parser import (
    AnswerDelta,
    ReasoningDelta,
    ReasoningMarkers,
    ReasoningParser,
    ReasoningParserEvent,
)
from vlite.core.tool_parser import partial_marker_length

OPEN = "<think>"
CLOSE = "</think>"

#: The parser has not yet seen whether the output opens with ``<think>``.
OPENING = "opening"
#: In the reasoning: everything up to ``</think>`` is reasoning.
REASONING = "reasoning"
#: After the reasoning (or with none): everything is answer, markers included.
ANSWER = "answer"


class ThinkTagReasoningParser(ReasoningParser):
    """Holds the output's start until it shows whether it opens with ``markers.start``
    (after whitespace, which is dropped with the marker); streams reasoning up to the end
    marker (holding back a suffix that could begin it), then the rest as answer, as it
    comes.

    A second start or end marker is text: in the reasoning it is reasoning, in the answer
    it is answer. A reply cut off inside its reasoning is all reasoning.
    """

    #: ``starts_in_reasoning``: whether an output that does not open with ``<think>``
    #: starts in its reasoning (templates that put ``<think>`` in the prompt) rather than
    #: being all answer.
    markers: ClassVar[ReasoningMarkers] = ReasoningMarkers(OPEN, CLOSE)

    def __init__(self) -> None:
        self._held = ""
        self._state = OPENING

    def feed(self, delta_text: str) -> list[ReasoningParserEvent]:
        self._held += delta_text
        events: list[ReasoningParserEvent] = []
        if self._state == OPENING:
            self._open()
        if self._state == REASONING:
            events += self._reasoning_step()
        if self._state == ANSWER:
            events += self._answer(self._take(len(self._held)))
        return events

    def _open(self) -> None:
        """Leave ``OPENING`` once the start of the output is known."""
        start = self._held.lstrip()
        if not start or (self.markers.start.startswith(start) and start != self.markers.start):
            return
        if start.startswith(self.markers.start):
            self._held = start[len(self.markers.start) :]
            self._state = REASONING
        else:
            self._state = REASONING if self.markers.starts_in_reasoning else ANSWER

    def _reasoning_step(self) -> list[ReasoningParserEvent]:
        """Reasoning up to ``</think>`` (then the answer begins), or up to a suffix that
        could begin it."""
        end = self._held.find(self.markers.end)
        if end >= 0:
            reasoning = self._take(end)
            self._take(len(self.markers.end))
            self._state = ANSWER
            return self._reasoning(reasoning)
        cut = len(self._held) - partial_marker_length(self._held, (self.markers.end,))
        return self._reasoning(self._take(cut))

    def finish(self) -> list[ReasoningParserEvent]:
        state = self._state
        if state == OPENING:  # a short output: all of it is its start
            state = REASONING if self.markers.starts_in_reasoning else ANSWER
        text = self._take(len(self._held))
        return self._reasoning(text) if state == REASONING else self._answer(text)

    def _take(self, length: int) -> str:
        """The first ``length`` held characters, no longer held."""
        taken, self._held = self._held[:length], self._held[length:]
        return taken

    @staticmethod
    def _reasoning(text: str) -> list[ReasoningParserEvent]:
        return [ReasoningDelta(text)] if text else []

    @staticmethod
    def _answer(text: str) -> list[ReasoningParserEvent]:
        return [AnswerDelta(text)] if text else []
