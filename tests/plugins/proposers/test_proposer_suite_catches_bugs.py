"""ProposerConformance fails on deliberately broken proposers (``broken_proposers.py``),
each in the tests meant to catch its bug, while the proposer itself loads fine and the
checks it does not break still pass. Each run writes a plugin author's test module with
pytester (a subclass of the suite naming a broken proposer).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from vlite.testing.suite_runs import assert_caught, run_suite_outcomes

HERE = Path(__file__).parent


@pytest.fixture(scope="module", autouse=True)
def _import_everything_first() -> None:
    """Import, in this process, all the inner runs will need (an in-process pytester run
    drops the modules it imported; importing an extension module twice can crash): the
    broken proposers, numpy, the suite and every built-in plugin."""
    import sys

    sys.path.insert(0, str(HERE))
    try:
        import broken_proposers  # noqa: F401
    finally:
        sys.path.remove(str(HERE))
    from vlite.core.plugins import PluginRegistry, build_plugin_manager
    from vlite.testing.conformance import proposer  # noqa: F401

    PluginRegistry(build_plugin_manager(load_entry_points=False))


TEST_MODULE = """
import broken_proposers
from vlite.testing import ProposerConformance


class TestBrokenProposer(ProposerConformance):
    plugin_name = {name!r}
    extra_plugins = (broken_proposers,)
    load_entry_points = False
{settings}
"""

FORM = "test_drafts_are_lists_of_python_ints_in_the_vocabulary"
MAX_DRAFTS = "test_no_request_gets_more_than_its_max_drafts"
ONLY_ASKED = "test_only_the_requests_asked_get_drafts"
SAME_TWICE = "test_the_same_requests_give_the_same_drafts"
BATCHES = {
    f"test_a_requests_drafts_do_not_depend_on_the_batch[{order}]"
    for order in ("as-listed", "reversed", "rotated", "interleaved")
}


def run_suite(pytester: pytest.Pytester, name: str, **settings) -> dict[str, str]:
    """Test name -> passed/failed/skipped, for the suite run on broken proposer ``name``
    (``settings``: class attributes of the test class)."""
    lines = "".join(f"    {key} = {value!r}\n" for key, value in settings.items())
    return run_suite_outcomes(pytester, HERE, TEST_MODULE.format(name=name, settings=lines))


def test_catches_one_draft_more_than_max_drafts(pytester):
    outcomes = run_suite(pytester, "one-too-many")
    assert_caught(
        outcomes,
        {MAX_DRAFTS, "test_a_long_context_is_answered"},
        {FORM, ONLY_ASKED, SAME_TWICE, *BATCHES},
    )


@pytest.mark.parametrize("name", ["numpy-ints", "float-tokens"])
def test_catches_drafts_that_are_not_python_ints(pytester, name):
    outcomes = run_suite(pytester, name)
    assert_caught(outcomes, {FORM, "test_a_long_context_is_answered"}, {MAX_DRAFTS, ONLY_ASKED})


def test_catches_drafts_for_ids_not_asked_about(pytester):
    outcomes = run_suite(pytester, "stale-ids")
    assert_caught(outcomes, {ONLY_ASKED}, {FORM, MAX_DRAFTS, SAME_TWICE})


def test_catches_random_drafts_from_a_proposer_that_claims_determinism(pytester):
    outcomes = run_suite(pytester, "random-guess")
    assert_caught(
        outcomes,
        {SAME_TWICE, *BATCHES, "test_finishing_unknown_or_finished_requests_is_harmless"},
        {FORM, MAX_DRAFTS, ONLY_ASKED},
    )


def test_a_proposer_that_says_it_is_not_deterministic_is_not_held_to_it(pytester):
    outcomes = run_suite(pytester, "random-guess", is_deterministic=False)
    assert {SAME_TWICE, *BATCHES} <= {n for n, o in outcomes.items() if o == "skipped"}
    assert set(outcomes.values()) <= {"passed", "skipped"}, outcomes


@pytest.mark.parametrize("learns", [None, True], ids=["claims-nothing", "claims-learning"])
def test_catches_drafts_that_depend_on_the_batch(pytester, learns):
    """Even a proposer that learns across requests is checked, with a fresh instance each
    time, for drafts that depend on the batch."""
    settings = {} if learns is None else {"learns_across_requests": learns}
    outcomes = run_suite(pytester, "batch-searching", **settings)
    assert_caught(outcomes, BATCHES, {FORM, MAX_DRAFTS, ONLY_ASKED, SAME_TWICE})
