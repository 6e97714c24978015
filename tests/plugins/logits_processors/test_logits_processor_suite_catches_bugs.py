"""LogitsProcessorConformance fails on deliberately broken processors
(``broken_processors.py``), each in the test meant to catch its bug, while the processor
itself loads fine and the checks it does not break still pass. Each run writes a plugin
author's test module with pytester (a subclass of the suite naming a broken processor).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from vlite.testing.suite_runs import assert_caught, run_suite_outcomes

HERE = Path(__file__).parent


@pytest.fixture(scope="module", autouse=True)
def _import_everything_first() -> None:
    """Import, in this process, all the inner runs will need.

    An in-process pytester run drops the modules it imported when it ends; importing
    torch's (or a grammar library's) extension modules a second time crashes the process.
    Building a registry here imports every built-in plugin once, before any inner run, and
    an op under the suite's dispatch mode imports what torch loads lazily for that
    (``torch._dynamo``, ``torch.distributed``).
    """
    import sys

    sys.path.insert(0, str(HERE))
    try:
        import broken_processors  # noqa: F401
    finally:
        sys.path.remove(str(HERE))
    from vlite.core.config import VliteConfig
    from vlite.core.plugins import PluginRegistry, build_plugin_manager
    from vlite.testing.conformance.logits_processor import TensorWorkRecorder

    PluginRegistry(build_plugin_manager(load_entry_points=False))
    VliteConfig()
    with TensorWorkRecorder():
        torch.zeros_like(torch.zeros(1), dtype=torch.bool)


TEST_MODULE = """
import broken_processors
from vlite.testing import LogitsProcessorConformance


class TestBrokenProcessor(LogitsProcessorConformance):
    plugin_name = {name!r}
    extra_plugins = (broken_processors,)
    load_entry_points = False
"""


def run_suite(pytester: pytest.Pytester, name: str) -> dict[str, str]:
    """Test name -> passed/failed/skipped, for the suite run on broken processor ``name``."""
    return run_suite_outcomes(pytester, HERE, TEST_MODULE.format(name=name))


#: Passes for every processor below: each edits the rows of its examples.
EXAMPLES_WORK = "test_active_params_change_their_rows"


def test_catches_a_processor_that_edits_every_row(pytester):
    outcomes = run_suite(pytester, "every-row-bias")
    assert_caught(
        outcomes,
        {
            "test_rows_of_other_requests_are_untouched",
            "test_a_row_gets_the_same_edit_alone_and_in_any_batch[reversed]",
            "test_output_tokens_appended_to_the_live_list_are_seen",
        },
        {EXAMPLES_WORK, "test_a_step_without_its_requests_does_no_tensor_work"},
    )


def test_catches_a_processor_that_keeps_removed_requests(pytester):
    outcomes = run_suite(pytester, "removed-keeping-bias")
    assert_caught(
        outcomes,
        {"test_a_removed_request_leaves_no_trace"},
        {
            EXAMPLES_WORK,
            "test_rows_of_other_requests_are_untouched",
            "test_a_row_gets_the_same_edit_alone_and_in_any_batch[rotated]",
            "test_rows_follow_the_batch_from_step_to_step",
        },
    )


def test_catches_a_processor_whose_edit_depends_on_the_row_position(pytester):
    outcomes = run_suite(pytester, "row-remembering-bias")
    assert_caught(
        outcomes,
        {"test_rows_follow_the_batch_from_step_to_step"},
        {
            EXAMPLES_WORK,
            "test_a_row_gets_the_same_edit_alone_and_in_any_batch[rotated]",
            "test_output_tokens_appended_to_the_live_list_are_seen",
        },
    )


def test_catches_a_processor_that_copies_the_tokens_it_is_given(pytester):
    outcomes = run_suite(pytester, "stale-tokens-min-tokens")
    assert_caught(
        outcomes,
        {"test_output_tokens_appended_to_the_live_list_are_seen"},
        {
            EXAMPLES_WORK,
            "test_a_row_gets_the_same_edit_alone_and_in_any_batch[as-listed]",
            "test_rows_follow_the_batch_from_step_to_step",
            "test_a_removed_request_leaves_no_trace",
        },
    )


def test_catches_a_processor_that_works_on_steps_it_does_not_apply_to(pytester):
    outcomes = run_suite(pytester, "always-masking-allowed")
    assert_caught(
        outcomes,
        {
            "test_a_step_without_its_requests_does_no_tensor_work",
            "test_a_removed_request_leaves_no_trace",
        },
        {
            EXAMPLES_WORK,
            "test_rows_of_other_requests_are_untouched",
            "test_a_row_gets_the_same_edit_alone_and_in_any_batch[as-listed]",
        },
    )


def test_catches_a_processor_that_changes_the_dtype(pytester):
    outcomes = run_suite(pytester, "float64-bias")
    assert_caught(
        outcomes,
        {
            "test_keeps_shape_dtype_and_device_and_adds_no_nan",
            "test_a_row_gets_the_same_edit_alone_and_in_any_batch[as-listed]",
        },
        set(),  # every step checks the logits' dtype
    )


def test_catches_a_processor_that_claims_to_follow_drafts_but_ignores_them(pytester):
    outcomes = run_suite(pytester, "draft-blind-bad-words")
    assert_caught(
        outcomes,
        {"test_rows_after_drafts_get_the_edit_of_their_context"},
        {
            EXAMPLES_WORK,
            "test_a_row_gets_the_same_edit_alone_and_in_any_batch[as-listed]",
            "test_output_tokens_appended_to_the_live_list_are_seen",
        },
    )
