"""``deepseek_r1``: DeepSeek-R1 and its distills (and templates like them that end the
prompt with ``<think>``): the output is reasoning until ``</think>``, then the answer.

As vLLM's parser of the same name: the output may or may not repeat the ``<think>`` the
prompt ended with, and an output with no ``</think>`` at all is all reasoning (the model
was cut off, or never left its reasoning), with or without a leading ``<think>``. That is
also what lets it stream: no text needs to wait for the end of the reply.
"""

from __future__ import annotations

from typing import ClassVar

from vlite.core.reasoning_parser import ReasoningMarkers, ReasoningParserExample
from vlite.plugins.reasoning_parsers.think_tags import CLOSE, OPEN, ThinkTagReasoningParser


class DeepSeekR1ReasoningParser(ThinkTagReasoningParser):
    """Reasoning until the first ``</think>`` (an optional leading ``<think>`` dropped),
    answer after it."""

    markers = ReasoningMarkers(OPEN, CLOSE, starts_in_reasoning=True)
    examples: ClassVar[tuple[ReasoningParserExample, ...]] = (
        ReasoningParserExample(
            "<think>\nTwo and two. Four.\n</think>\n\nIt is 4.",
            "\nTwo and two. Four.\n",
            "\n\nIt is 4.",
        ),
        ReasoningParserExample("Prompt opened it.</think>Answer.", "Prompt opened it.", "Answer."),
        ReasoningParserExample(
            "  <think>a <thinking> aside</think>b </think> <think>",
            "a <thinking> aside",
            "b </think> <think>",
        ),
        ReasoningParserExample(
            "<think>cut off in the reasoning </thi", "cut off in the reasoning </thi", ""
        ),
        ReasoningParserExample(
            "No marker at all: all reasoning.", "No marker at all: all reasoning.", ""
        ),
        ReasoningParserExample("</think>Only an answer.", "", "Only an answer."),
        ReasoningParserExample("<think></think>", "", ""),
        ReasoningParserExample("<thi", "<thi", ""),
    )
