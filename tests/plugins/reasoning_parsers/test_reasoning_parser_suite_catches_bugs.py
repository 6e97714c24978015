"""ReasoningParserConformance fails on deliberately broken parsers
(``broken_reasoning_parsers.py``), each in the tests meant to catch its bug, while the
parser itself loads fine and the checks it does not break still pass. Each run writes a
plugin author's test module with pytester (a subclass of the suite naming a broken parser).
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
        import broken_reasoning_parsers  # noqa: F401
    finally:
        sys.path.remove(str(HERE))
    from vlite.core.plugins import PluginRegistry, build_plugin_manager
    from vlite.testing.conformance import reasoning_parser  # noqa: F401

    PluginRegistry(build_plugin_manager(load_entry_points=False))


TEST_MODULE = """
import broken_reasoning_parsers
from vlite.plugins.reasoning_parsers.deepseek_r1 import DeepSeekR1ReasoningParser
from vlite.testing import ReasoningParserConformance


class TestBrokenReasoningParser(ReasoningParserConformance):
    plugin_name = {name!r}
    extra_plugins = (broken_reasoning_parsers,)
    load_entry_points = False
    examples = DeepSeekR1ReasoningParser.examples
"""

GOLDEN = "test_examples_parse_to_their_reasoning_and_answer"
STREAMS = "test_examples_stream_as_they_parse_however_cut"
CUT_OFF = "test_cut_off_outputs_stream_as_they_parse"
HAS_BOTH = "test_examples_include_reasoning_and_an_answer"
EMPTY = "test_an_empty_reply_gives_nothing"
MARKERS = "test_declared_markers_split_as_the_parser_does"


def run_suite(pytester: pytest.Pytester, name: str) -> dict[str, str]:
    return run_suite_outcomes(pytester, HERE, TEST_MODULE.format(name=name))


def test_catches_a_marker_split_across_deltas_sent_as_reasoning(pytester):
    outcomes = run_suite(pytester, "leaks-split-markers")
    assert_caught(outcomes, {STREAMS, CUT_OFF}, {GOLDEN, HAS_BOTH, EMPTY})


def test_catches_answer_text_lost_after_the_closing_marker(pytester):
    outcomes = run_suite(pytester, "loses-answer-text")
    assert_caught(outcomes, {GOLDEN, STREAMS}, {HAS_BOTH, EMPTY})


def test_catches_markers_the_parser_does_not_split_by(pytester):
    outcomes = run_suite(pytester, "misdeclares-markers")
    assert_caught(outcomes, {MARKERS}, {GOLDEN, STREAMS, CUT_OFF, HAS_BOTH, EMPTY})
