"""The tool-parser kind's shared pieces: call ids, the held-back marker suffix, joining
events, and the built-ins' registration."""

from __future__ import annotations

import json
from pathlib import Path

from vlite.core.config import read_toml_file
from vlite.core.plugins import PluginRegistry, build_plugin_manager
from vlite.core.tool_parser import (
    ArgumentsDelta,
    ContentDelta,
    ToolCallStart,
    join_events,
    new_tool_call_id,
    partial_marker_length,
)
from vlite.plugins.tool_parsers.hermes import HermesToolParser
from vlite.plugins.tool_parsers.pythonic import PythonicToolParser
from vlite.testing.conformance.tool_parser import CALL_ID

WEATHER = [{"type": "function", "function": {"name": "get_weather"}}]


def test_call_ids_look_like_openais_and_differ():
    ids = {new_tool_call_id() for _ in range(100)}
    assert len(ids) == 100
    assert all(CALL_ID.fullmatch(call_id) and len(call_id) == 29 for call_id in ids)


def test_the_held_back_suffix_is_the_longest_that_could_begin_a_marker():
    assert partial_marker_length("text <tool_", ["<tool_call>"]) == 6
    assert partial_marker_length("text <tool_call", ["<tool_call>"]) == 10
    assert partial_marker_length("text <", ["<tool_call>", "[TOOL"]) == 1
    assert partial_marker_length("text", ["<tool_call>"]) == 0
    assert partial_marker_length("", ["<tool_call>"]) == 0


def test_events_join_to_content_and_calls_in_order():
    events = [
        ContentDelta("a"),
        ToolCallStart(0, "call_x", "f"),
        ArgumentsDelta(0, '{"k": '),
        ContentDelta("b"),
        ArgumentsDelta(0, "1}"),
        ToolCallStart(1, "call_y", "g"),
    ]
    result = join_events(events)
    assert result.content == "ab"
    assert [(c.id, c.name, c.arguments) for c in result.calls] == [
        ("call_x", "f", '{"k": 1}'),
        ("call_y", "g", ""),
    ]


def test_a_hermes_call_is_announced_only_once_its_closing_tag_arrived():
    parser = HermesToolParser(WEATHER)
    assert parser.feed("Hi <tool_") == [ContentDelta("Hi ")]
    assert parser.feed('call>{"name": "get_weather", "arguments": {"city": "Rome"}}') == []
    start, arguments = parser.feed("</tool_call>")
    assert isinstance(start, ToolCallStart) and start.name == "get_weather"
    assert json.loads(arguments.text) == {"city": "Rome"}
    assert parser.finish() == []


def test_pythonic_never_evaluates_what_the_model_wrote():
    text = "[get_weather(city=print('side effect'))]"
    assert PythonicToolParser(WEATHER).parse(text).calls == ()


def test_the_built_ins_are_registered_and_listed_in_pyproject():
    registry = PluginRegistry(build_plugin_manager(load_entry_points=False))
    assert registry.names("tool_parser") == ["hermes", "llama3_json", "mistral", "pythonic"]
    pyproject = read_toml_file(Path(__file__).parents[3] / "pyproject.toml")
    builtins = pyproject["project"]["entry-points"]["vlite.builtin"]
    assert builtins["vlite.plugins.tool_parsers.builtin"] == "vlite.plugins.tool_parsers.builtin"
