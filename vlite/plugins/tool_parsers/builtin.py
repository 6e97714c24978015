"""Registers vlite's built-in tool-call parsers (a ``vlite.builtin`` entry point)."""

from __future__ import annotations

from vlite.core.hookspecs import hookimpl
from vlite.plugins.tool_parsers.hermes import HermesToolParser
from vlite.plugins.tool_parsers.llama3_json import Llama3JsonToolParser
from vlite.plugins.tool_parsers.mistral import MistralToolParser
from vlite.plugins.tool_parsers.pythonic import PythonicToolParser


@hookimpl
def register_tool_parsers(register):
    register("hermes", HermesToolParser)
    register("llama3_json", Llama3JsonToolParser)
    register("mistral", MistralToolParser)
    register("pythonic", PythonicToolParser)
