"""``qwen3``: Qwen3 (and SmolLM3 with ``/think``), whose output opens with ``<think>`` when
the model thinks: reasoning between that ``<think>`` and ``</think>``, the answer after.

An output that does not open with ``<think>`` (after whitespace) has no reasoning: all of
it is answer, a ``</think>`` in it included (Qwen3 with thinking off, whose template puts
an empty ``<think></think>`` in the prompt). An output that opens with ``<think>`` and has
no ``</think>`` was cut off in its reasoning: all of it is reasoning. (vLLM's non-streamed
path called that answer while its stream sent it as reasoning; here both are reasoning.)
For templates that end the prompt with ``<think>``, use ``deepseek_r1``.
"""

from __future__ import annotations

from typing import ClassVar

from vlite.core.reasoning_parser import ReasoningMarkers, ReasoningParserExample
from vlite.plugins.reasoning_parsers.think_tags import CLOSE, OPEN, ThinkTagReasoningParser


class Qwen3ReasoningParser(ThinkTagReasoningParser):
    """Reasoning only between a leading ``<think>`` and the first ``</think>``."""

    markers = ReasoningMarkers(OPEN, CLOSE)
    examples: ClassVar[tuple[ReasoningParserExample, ...]] = (
        ReasoningParserExample(
            "<think>\nTwo and two. Four.\n</think>\n\nIt is 4.",
            "\nTwo and two. Four.\n",
            "\n\nIt is 4.",
        ),
        ReasoningParserExample(
            '\n<think>Maybe <tool_call>{"name": "f"}</tool_call>? No.</think>'
            '<tool_call>{"name": "f"}</tool_call>',
            'Maybe <tool_call>{"name": "f"}</tool_call>? No.',
            '<tool_call>{"name": "f"}</tool_call>',
        ),
        ReasoningParserExample(
            "No reasoning.</think> <think>x", "", "No reasoning.</think> <think>x"
        ),
        ReasoningParserExample(
            "<think>cut off in the reasoning </thi", "cut off in the reasoning </thi", ""
        ),
        ReasoningParserExample("<think>a <think> b</think></think>", "a <think> b", "</think>"),
        ReasoningParserExample("<think></think>", "", ""),
        ReasoningParserExample(" <thi", "", " <thi"),
        ReasoningParserExample("  ", "", "  "),
    )
