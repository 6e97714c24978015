"""StructuredOutputBackendConformance fails on deliberately broken backends
(``broken_backends.py``), each in the tests meant to catch its bug, while the checks the bug
does not touch still pass. Each run writes a plugin author's test module with pytester."""

from __future__ import annotations

from pathlib import Path

import pytest

from vlite.testing.suite_runs import run_suite_outcomes

HERE = Path(__file__).parent

TEST_MODULE = """
import broken_backends
from vlite.testing import StructuredOutputBackendConformance


class TestBrokenBackend(StructuredOutputBackendConformance):
    plugin_name = {name!r}
    extra_plugins = (broken_backends,)
    load_entry_points = False
"""
EXACT = "test_masks_are_exact_for_a_finite_language"
FORBIDDEN = "test_a_forbidden_token_is_refused_and_changes_nothing"
ROLLBACK = "test_rollback_returns_to_the_earlier_masks"
ROWS = "test_rows_are_filled_alone_whatever_the_batch"
JSON = "test_json_outputs_parse_and_validate"
INDEPENDENT = "test_matchers_of_one_compiled_grammar_are_independent"
VALIDATE = "test_validate_and_compile_refuse_what_cannot_compile"


@pytest.fixture(scope="module", autouse=True)
def _import_everything_first() -> None:
    """Import here what the in-process runs need (a second import of an extension module
    after pytester dropped it would crash the process)."""
    import sys

    sys.path.insert(0, str(HERE))
    try:
        import broken_backends  # noqa: F401
    finally:
        sys.path.remove(str(HERE))
    import jsonschema  # noqa: F401

    from vlite.core.plugins import PluginRegistry, build_plugin_manager
    from vlite.testing.conformance import structured_output  # noqa: F401

    PluginRegistry(build_plugin_manager(load_entry_points=False))


def outcomes_for(pytester, name: str) -> dict[str, str]:
    return run_suite_outcomes(pytester, HERE, TEST_MODULE.format(name=name))


def failed(outcomes: dict[str, str]) -> set[str]:
    return {name.split("[")[0] for name, outcome in outcomes.items() if outcome == "failed"}


def passed(outcomes: dict[str, str]) -> set[str]:
    return {name for name, outcome in outcomes.items() if outcome == "passed"}


@pytest.mark.parametrize(
    ("name", "caught", "unaffected"),
    [
        ("extra-token", {EXACT}, {ROWS, INDEPENDENT, FORBIDDEN}),
        ("no-rollback", {ROLLBACK}, {EXACT + "[choice]", ROWS, FORBIDDEN, JSON}),
        ("row-zero", {ROWS}, {EXACT + "[regex]", ROLLBACK, FORBIDDEN}),
        ("lenient", {FORBIDDEN}, {EXACT + "[grammar]", ROLLBACK, ROWS}),
        ("never-ends", {EXACT, JSON}, {ROLLBACK, ROWS, FORBIDDEN}),
        ("validates-nothing", {VALIDATE}, {EXACT + "[json]", ROLLBACK, ROWS}),
    ],
)
def test_the_suite_catches_a_broken_backend(pytester, name, caught, unaffected):
    outcomes = outcomes_for(pytester, name)

    assert outcomes["test_plugin_loads_through_a_fresh_plugin_manager"] == "passed"
    assert caught <= failed(outcomes), f"missed: {caught - failed(outcomes)}"
    assert unaffected <= passed(outcomes), f"failed beyond the bug: {unaffected - passed(outcomes)}"


def test_the_real_backends_pass_the_same_checks(pytester):
    module = TEST_MODULE.replace("broken_backends.", "").replace(
        "extra_plugins = (broken_backends,)", "extra_plugins = ()"
    )
    outcomes = run_suite_outcomes(pytester, HERE, module.format(name="xgrammar"))

    assert failed(outcomes) == set(), outcomes
