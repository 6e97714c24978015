"""The fault-injecting model plugin, and what the engine does after a failed step."""

from __future__ import annotations

import pytest

from vlite import LLM, SamplingParams
from vlite.core.plugins import PluginRegistry, build_plugin_manager
from vlite.testing import faults
from vlite.testing.engine_runs import cached_tiny_model

FAULT_TOKEN_ID = 310
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def registry() -> PluginRegistry:
    return PluginRegistry(build_plugin_manager(extra_plugins=(faults,)))


@pytest.fixture(scope="module")
def faulty_model(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("faulty") / "model"
    return str(faults.make_faulty_model(folder, cached_tiny_model(), FAULT_TOKEN_ID, "raise"))


def make_llm(model: str, registry: PluginRegistry) -> LLM:
    return LLM(model=model, registry=registry, block_size=4, num_kv_blocks=64)


def generate(llm: LLM, prompt: list[int]) -> list[int]:
    output = llm.generate([{"prompt_token_ids": prompt}], GREEDY, use_tqdm=False)[0]
    return output.outputs[0].token_ids


def test_the_faulty_model_generates_like_the_plain_one_until_the_fault(faulty_model, registry):
    prompts = [[5, 6, 7], list(range(20, 45))]
    plain = LLM(model=str(cached_tiny_model()), block_size=4, num_kv_blocks=64)
    faulty = make_llm(faulty_model, registry)
    for prompt in prompts:
        assert generate(faulty, prompt) == generate(plain, prompt)
    with pytest.raises(faults.InjectedFault, match=faults.FAULT_MARKER):
        generate(faulty, [5, FAULT_TOKEN_ID, 6])


def test_the_faulty_model_never_generates_the_fault_token(faulty_model, registry):
    llm = make_llm(faulty_model, registry)
    sampled = SamplingParams(max_tokens=64, temperature=5.0, seed=0, ignore_eos=True)
    output = llm.generate([{"prompt_token_ids": [5, 6]}], sampled, use_tqdm=False)[0]
    assert FAULT_TOKEN_ID not in output.outputs[0].token_ids


def test_an_unknown_fault_mode_is_refused(tmp_path):
    with pytest.raises(ValueError, match="mode='crash'"):
        faults.make_faulty_model(tmp_path, cached_tiny_model(), FAULT_TOKEN_ID, "crash")


def test_blocks_of_a_failed_step_are_not_served_from_the_prefix_cache(faulty_model, registry):
    prefix = list(range(30, 46))  # four full blocks of four tokens
    llm = make_llm(faulty_model, registry)
    with pytest.raises(faults.InjectedFault):
        generate(llm, [*prefix, FAULT_TOKEN_ID])  # its step fails: no block is written
    expected = generate(make_llm(faulty_model, registry), [*prefix, 60])
    assert generate(llm, [*prefix, 60]) == expected
