"""``pythonic``: tool calls as a Python list of calls, ``[f(a=1), g(b="x")]``, as the whole
output (Llama 3.2's and 4's format). Read with :mod:`ast`: keyword arguments whose values
are literals only; nothing is ever evaluated."""

from __future__ import annotations

import ast
import json
from collections.abc import Mapping
from typing import Any, ClassVar

from vlite.core.tool_parser import ToolParserExample
from vlite.plugins.tool_parsers.whole_output import WholeOutputToolParser


class PythonicToolParser(WholeOutputToolParser):
    """Reads a whole output that is a list of calls; any other output (prose, a call with
    a positional argument or a value that is no literal, text after the list) is content."""

    openers = ("[",)
    # No template_markers: no wording in the templates that ask for this format is its own
    # for sure; it is chosen only by name (--tool-call-parser pythonic).
    examples: ClassVar[tuple[ToolParserExample, ...]] = (
        ToolParserExample(
            '[get_weather(city="Paris", days=2)]',
            "",
            (("get_weather", {"city": "Paris", "days": 2}),),
        ),
        ToolParserExample(
            ' [get_weather(city="Oslo]", unit=None, tags=["a", (1, 2)]), get_time()]\n',
            "",
            (
                ("get_weather", {"city": "Oslo]", "unit": None, "tags": ["a", [1, 2]]}),
                ("get_time", {}),
            ),
        ),
        ToolParserExample("Sunny, 20 degrees."),
        ToolParserExample("[1] is a citation."),
        ToolParserExample('[get_weather(city="Pa'),
        ToolParserExample('[get_weather("Paris")]'),
        ToolParserExample("[get_weather(city=__import__('os').getcwd())]"),
        ToolParserExample("[get_weather(city={1, 2})]"),
        ToolParserExample("[]"),
    )

    def read_calls(self, text: str) -> list[tuple[Any, Mapping[str, Any]]] | None:
        try:
            tree = ast.parse(text.strip(), mode="eval")
        except (SyntaxError, ValueError):
            return None
        if not isinstance(tree.body, ast.List):
            return None
        calls = [_call(node) for node in tree.body.elts]
        return None if any(call is None for call in calls) else calls


def _call(node: ast.expr) -> tuple[str, dict[str, Any]] | None:
    """``(name, arguments)`` of ``f(a=literal, ...)``, or ``None`` for anything else."""
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
        return None
    arguments = {}
    for keyword in node.keywords:
        if keyword.arg is None:  # **kwargs
            return None
        try:
            value = ast.literal_eval(keyword.value)
            json.dumps(value)  # a literal JSON cannot hold (a set, bytes, ...) is refused
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            return None
        arguments[keyword.arg] = value
    return node.func.id, arguments
