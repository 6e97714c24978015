"""The reasoning-parser kind's shared pieces: joining events, the think-tag parsers'
held-back marker, and the built-ins' registration."""

from __future__ import annotations

from pathlib import Path

from vlite.core.config import read_toml_file
from vlite.core.plugins import PluginRegistry, build_plugin_manager
from vlite.core.reasoning_parser import (
    AnswerDelta,
    ReasoningDelta,
    ReasoningParseResult,
    join_reasoning_events,
)
from vlite.plugins.reasoning_parsers.deepseek_r1 import DeepSeekR1ReasoningParser
from vlite.plugins.reasoning_parsers.qwen3 import Qwen3ReasoningParser


def test_events_join_to_reasoning_and_answer():
    events = [ReasoningDelta("a"), ReasoningDelta("b"), AnswerDelta("c"), AnswerDelta("d")]
    assert join_reasoning_events(events) == ReasoningParseResult("ab", "cd")


def test_a_split_closing_marker_is_held_until_it_is_known():
    parser = Qwen3ReasoningParser()
    assert parser.feed("<thi") == []
    assert parser.feed("nk>Hmm </th") == [ReasoningDelta("Hmm ")]
    assert parser.feed("ink>Yes") == [AnswerDelta("Yes")]
    assert parser.finish() == []


def test_the_two_built_ins_differ_on_an_output_without_think():
    text = "plain words</think>answer"
    assert DeepSeekR1ReasoningParser().parse(text) == ReasoningParseResult("plain words", "answer")
    assert Qwen3ReasoningParser().parse(text) == ReasoningParseResult("", text)


def test_the_built_ins_are_registered_and_listed_in_pyproject():
    registry = PluginRegistry(build_plugin_manager(load_entry_points=False))
    assert registry.names("reasoning_parser") == ["deepseek_r1", "qwen3"]
    pyproject = read_toml_file(Path(__file__).parents[3] / "pyproject.toml")
    builtins = pyproject["project"]["entry-points"]["vlite.builtin"]
    module = "vlite.plugins.reasoning_parsers.builtin"
    assert builtins[module] == module
