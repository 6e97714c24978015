"""WeightFormatConformance fails on deliberately broken weight formats
(``broken_weight_formats.py``), each in the tests meant to catch its bug, while the format
itself loads fine and the checks it does not break still pass. Each run writes a plugin
author's test module with pytester (a subclass of the suite naming a broken format).
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
    broken formats, every built-in plugin, gguf-py, and a tiny engine run."""
    import sys

    sys.path.insert(0, str(HERE))
    try:
        import broken_weight_formats  # noqa: F401
    finally:
        sys.path.remove(str(HERE))
    import gguf  # noqa: F401

    from vlite.core.plugins import PluginRegistry, build_plugin_manager
    from vlite.engine.llm import LLM
    from vlite.testing.conformance import weight_format  # noqa: F401
    from vlite.testing.engine_runs import cached_tiny_model
    from vlite.testing.tiny_gguf import write_tiny_gguf  # noqa: F401

    PluginRegistry(build_plugin_manager(load_entry_points=False))
    LLM(model=str(cached_tiny_model("LlamaForCausalLM", num_kv_heads=2)), num_kv_blocks=8)


TEST_MODULE = """
import broken_weight_formats
from vlite.testing import WeightFormatConformance


class TestBrokenFormat(WeightFormatConformance):
    plugin_name = {name!r}
    extra_plugins = (broken_weight_formats.PLUGINS[{name!r}],)
    load_entry_points = False
"""


def run_suite(pytester: pytest.Pytester, name: str) -> dict[str, str]:
    """Test name -> passed/failed/skipped, for the suite run on broken format ``name``."""
    return run_suite_outcomes(pytester, HERE, TEST_MODULE.format(name=name))


def test_catches_column_shards_cut_at_the_wrong_bytes(pytester):
    outcomes = run_suite(pytester, "byte-offset-columns")
    assert_caught(
        outcomes,
        {"test_column_shards_on_block_boundaries_equal_the_slices_of_the_whole"},
        {
            "test_linear_equals_the_dense_product_of_the_dequantized_values",
            "test_row_shards_equal_the_rows_of_the_whole",
        },
    )


def test_catches_a_product_that_drops_the_last_block(pytester):
    outcomes = run_suite(pytester, "last-block-dropping")
    assert_caught(
        outcomes,
        {
            "test_linear_equals_the_dense_product_of_the_dequantized_values",
            "test_empty_and_single_row_batches",
            "test_row_shards_equal_the_rows_of_the_whole",
            "test_greedy_tokens_of_a_tiny_model_equal_its_float32_path",
        },
        {"test_embedding_gathers_exactly_the_dequantized_rows"},
    )


def test_catches_a_column_slice_off_the_blocks_that_is_not_refused(pytester):
    outcomes = run_suite(pytester, "rounding-down-slice")
    assert_caught(
        outcomes,
        {"test_a_column_slice_off_the_blocks_is_refused_naming_the_type"},
        {"test_column_shards_on_block_boundaries_equal_the_slices_of_the_whole"},
    )


def test_catches_experts_that_all_run_as_the_first(pytester):
    outcomes = run_suite(pytester, "first-expert-only")
    assert_caught(
        outcomes,
        {"test_expert_linear_equals_each_experts_dense_product"},
        {
            "test_linear_equals_the_dense_product_of_the_dequantized_values",
            "test_greedy_tokens_of_a_tiny_model_equal_its_float32_path",
        },
    )
