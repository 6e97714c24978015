"""Registers vlite's built-in reasoning parsers (a ``vlite.builtin`` entry point)."""

from __future__ import annotations

from vlite.core.hookspecs import hookimpl
from vlite.plugins.reasoning_parsers.deepseek_r1 import DeepSeekR1ReasoningParser
from vlite.plugins.reasoning_parsers.qwen3 import Qwen3ReasoningParser


@hookimpl
def register_reasoning_parsers(register):
    register("deepseek_r1", DeepSeekR1ReasoningParser)
    register("qwen3", Qwen3ReasoningParser)
