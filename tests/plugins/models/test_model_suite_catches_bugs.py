"""ModelConformance fails on deliberately wrong models (``broken_models.py``) while they
load fine. Each run writes a plugin author's test module with pytester (a subclass of the
suite naming a broken ``GraniteForCausalLM``) and runs it in process."""

from __future__ import annotations

from pathlib import Path

import pytest

from vlite.testing.suite_runs import run_suite_outcomes

HERE = Path(__file__).parent

TOKEN_TESTS = (
    "test_one_prompt_at_a_time_equals_transformers",
    "test_a_batch_equals_transformers",
    "test_prefix_cache_hits_equal_transformers",
    "test_forced_preemption_equals_transformers",
)

TEST_MODULE = """
import broken_models
from vlite.testing import ModelConformance


class TestBrokenModel(ModelConformance):
    plugin_name = "GraniteForCausalLM"
    extra_plugins = (broken_models.{plugin},)
    load_entry_points = False
    supports_tensor_parallel = False  # worker processes: slow, and not what is tested
    tiny_config = {{
        "embedding_multiplier": 2.0,
        "attention_multiplier": 0.1,
        "residual_multiplier": 0.5,
        "logits_scaling": 4.0,
    }}
"""


@pytest.fixture(scope="module", autouse=True)
def _import_everything_first() -> None:
    """Import, in this process, all the inner runs need (an in-process pytester run drops
    the modules it imported; importing torch's extension modules twice crashes)."""
    import broken_models  # noqa: F401

    from vlite.core.plugins import PluginRegistry, build_plugin_manager
    from vlite.engine.llm import LLM
    from vlite.testing.conformance import model  # noqa: F401
    from vlite.testing.engine_runs import cached_tiny_model, transformers_greedy

    folder = cached_tiny_model("LlamaForCausalLM")
    transformers_greedy(folder, [[5, 6]], 1)
    registry = PluginRegistry(build_plugin_manager(load_entry_points=False))
    llm = LLM(model=str(folder), registry=registry, num_kv_blocks=8)
    llm.generate([{"prompt_token_ids": [5, 6]}], use_tqdm=False)


@pytest.mark.parametrize(
    "plugin", ["ignores_multipliers", "noisy_logits", "unscaled_logits", "swapped_layers"]
)
def test_the_suite_fails_a_wrong_model_in_every_token_test(pytester, plugin):
    outcomes = run_suite_outcomes(pytester, HERE, TEST_MODULE.format(plugin=plugin))
    assert outcomes["test_plugin_loads_through_a_fresh_plugin_manager"] == "passed"
    assert {name: outcomes[name] for name in TOKEN_TESTS} == dict.fromkeys(TOKEN_TESTS, "failed")
    assert outcomes["test_tensor_parallel_equals_transformers"] == "skipped"


def test_tensor_parallel_is_skipped_naming_the_refusal(pytester):
    """A tiny config the class cannot split (one KV head over two ranks) skips the
    tensor-parallel test with the class's own refusal, and nothing else."""
    pytester.makepyfile(
        test_one_kv_head="""
from vlite.testing import ModelConformance


class TestOneKvHead(ModelConformance):
    plugin_name = "LlamaForCausalLM"
    load_entry_points = False
    tiny_config = {"num_kv_heads": 1}
"""
    )
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-rs", "-k", "tensor_parallel")
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(
        ["*LlamaForCausalLM.check_tensor_parallel_size refuses tensor_parallel_size=2*"]
    )
