"""Deliberately broken reasoning parsers: ReasoningParserConformance must fail on each.

Each is a small change to the built-in ``deepseek_r1`` parser, of the kind a parser author
could make by mistake. ``test_reasoning_parser_suite_catches_bugs.py`` runs the suite on
them.
"""

from __future__ import annotations

from vlite.core.hookspecs import hookimpl
from vlite.plugins.reasoning_parsers import think_tags
from vlite.plugins.reasoning_parsers.deepseek_r1 import DeepSeekR1ReasoningParser


class LeaksSplitMarkersParser(DeepSeekR1ReasoningParser):
    """Looks for ``</think>`` only in the text held as each delta comes, holding nothing
    back: a marker split across two deltas is sent as reasoning, and so is the answer."""

    def _reasoning_step(self):
        if think_tags.CLOSE in self._held:
            return super()._reasoning_step()
        return self._reasoning(self._take(len(self._held)))


class LosesAnswerTextParser(DeepSeekR1ReasoningParser):
    """Forgets the text after ``</think>`` in the delta that closed the reasoning (it
    switches to the answer, but drops what was held)."""

    def _reasoning_step(self):
        events = super()._reasoning_step()
        if self._state == think_tags.ANSWER:
            self._held = ""
        return events


class MisdeclaresMarkersParser(DeepSeekR1ReasoningParser):
    """Splits as ``deepseek_r1`` (at ``</think>``) but declares ``</thought>`` as its end
    marker: a grammar trusting the declaration would constrain the wrong text."""

    markers = think_tags.ReasoningMarkers(think_tags.OPEN, "</thought>", starts_in_reasoning=True)

    def __init__(self) -> None:
        super().__init__()
        self.markers = DeepSeekR1ReasoningParser.markers  # what it really splits by


@hookimpl
def register_reasoning_parsers(register):
    register("leaks-split-markers", LeaksSplitMarkersParser)
    register("loses-answer-text", LosesAnswerTextParser)
    register("misdeclares-markers", MisdeclaresMarkersParser)
