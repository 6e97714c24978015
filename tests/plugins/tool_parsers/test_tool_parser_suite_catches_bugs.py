"""ToolParserConformance fails on deliberately broken parsers (``broken_tool_parsers.py``),
each in the tests meant to catch its bug, while the parser itself loads fine and the
checks it does not break still pass. Each run writes a plugin author's test module with
pytester (a subclass of the suite naming a broken parser).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from vlite.testing.suite_runs import assert_caught, run_suite_outcomes

HERE = Path(__file__).parent


@pytest.fixture(scope="module", autouse=True)
def _import_everything_first() -> None:
    """Import, in this process, all the inner runs will need (an in-process pytester run
    drops the modules it imported): the broken parsers, the suite, every built-in."""
    import sys

    sys.path.insert(0, str(HERE))
    try:
        import broken_tool_parsers  # noqa: F401
    finally:
        sys.path.remove(str(HERE))
    from vlite.core.plugins import PluginRegistry, build_plugin_manager
    from vlite.testing.conformance import tool_parser  # noqa: F401

    PluginRegistry(build_plugin_manager(load_entry_points=False))


TEST_MODULE = """
import broken_tool_parsers
from vlite.plugins.tool_parsers.hermes import HermesToolParser
from vlite.testing import ToolParserConformance


class TestBrokenToolParser(ToolParserConformance):
    plugin_name = {name!r}
    extra_plugins = (broken_tool_parsers,)
    load_entry_points = False
    examples = HermesToolParser.examples
"""

GOLDEN = "test_examples_parse_to_their_content_and_calls"
STREAMS = "test_examples_stream_as_they_parse_however_cut"
CUT_OFF = "test_cut_off_outputs_stream_as_they_parse"
NOT_OFFERED = "test_calls_of_functions_not_offered_are_content"
ARGUMENTS = "test_arguments_are_json_objects"


def run_suite(pytester: pytest.Pytester, name: str) -> dict[str, str]:
    return run_suite_outcomes(pytester, HERE, TEST_MODULE.format(name=name))


def test_catches_a_marker_split_across_deltas_sent_as_content(pytester):
    outcomes = run_suite(pytester, "leaks-split-markers")
    assert_caught(outcomes, {STREAMS, CUT_OFF}, {GOLDEN, NOT_OFFERED, ARGUMENTS})


def test_catches_content_after_a_call_dropped(pytester):
    outcomes = run_suite(pytester, "drops-content-after-calls")
    assert_caught(outcomes, {GOLDEN}, {NOT_OFFERED, ARGUMENTS})
