"""The Worker and its ModelRunner driven directly, one SchedulerOutput at a time: the
diff applied to per-request state, what a step samples, and greedy tokens equal to
transformers' on a tiny Llama."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from vlite.core.config import VliteConfig
from vlite.core.errors import ConfigError
from vlite.core.outputs import CachedRequestData, NewRequestData, SchedulerOutput
from vlite.core.plugins import PluginRegistry, build_plugin_manager
from vlite.core.sampling_params import SamplingParams
from vlite.testing.engine_runs import cached_tiny_model
from vlite.worker.worker import Worker

BLOCK_SIZE = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)


@pytest.fixture(scope="module")
def folder():
    return cached_tiny_model("LlamaForCausalLM")


@pytest.fixture(scope="module")
def worker(folder):
    config = VliteConfig(
        model=str(folder), block_size=BLOCK_SIZE, num_kv_blocks=16, enforce_eager=True
    )
    worker = Worker(config, PluginRegistry(build_plugin_manager()))
    worker.load_model()
    worker.initialize_kv_cache(worker.determine_num_kv_blocks())
    return worker


@pytest.fixture(scope="module")
def reference(folder):
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)


def hf_greedy(model, prompt: list[int], num_tokens: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=num_tokens, do_sample=False, eos_token_id=None
        )
    return out[0, len(prompt) :].tolist()


def new(request_id: str, prompt: list[int], blocks: list[int], params=GREEDY) -> NewRequestData:
    return NewRequestData(request_id, list(prompt), params, blocks, 0, len(prompt))


def scheduler_output(**diff) -> SchedulerOutput:
    empty = {
        "new_requests": [],
        "cached_requests": [],
        "num_scheduled_tokens": {},
        "finished_request_ids": [],
    }
    return SchedulerOutput(**{**empty, **diff})


def step(worker: Worker, **diff) -> dict[str, list[int]]:
    output = scheduler_output(**diff)
    worker.execute_model(output)
    return worker.sample_tokens().sampled_token_ids


def test_a_new_request_becomes_worker_state_with_its_own_lists(worker):
    request = new("own-lists", [5, 6, 7], [3])
    step(worker, new_requests=[request], num_scheduled_tokens={"own-lists": 3})
    state = worker.runner.requests["own-lists"]
    assert state.token_ids[:3] == [5, 6, 7] and state.token_ids is not request.token_ids
    assert state.block_ids == [3] and state.block_ids is not request.block_ids
    assert state.num_computed_tokens == 3 and state.num_prompt_tokens == 3
    assert not state.reads_own_tokens and state.generator is None
    step(worker, finished_request_ids=["own-lists"])
    assert "own-lists" not in worker.runner.requests


def test_sampling_settings_are_derived_once(worker):
    params = SamplingParams(seed=3, repetition_penalty=1.2, max_tokens=4)
    step(worker, new_requests=[new("derived", [5, 6], [4], params)], num_scheduled_tokens={})
    state = worker.runner.requests["derived"]
    assert state.generator is not None and state.has_sampling_extras and state.reads_own_tokens
    step(worker, finished_request_ids=["derived"])


def test_greedy_decode_steps_equal_transformers(worker, reference):
    prompt = [11, 42, 7, 99, 3]
    expected = hf_greedy(reference, prompt, 4)
    sampled = step(worker, new_requests=[new("g", prompt, [0])], num_scheduled_tokens={"g": 5})
    tokens = sampled["g"]
    for _ in range(3):
        cached = CachedRequestData("g", [], len(prompt) + len(tokens) - 1)
        tokens += step(worker, cached_requests=[cached], num_scheduled_tokens={"g": 1})["g"]
    assert tokens == expected
    assert worker.runner.requests["g"].token_ids == prompt + tokens
    step(worker, finished_request_ids=["g"])


def test_a_prompt_chunk_samples_nothing_until_the_prompt_ends(worker, reference):
    prompt = list(range(20, 40))
    expected = hf_greedy(reference, prompt, 1)
    first = step(worker, new_requests=[new("c", prompt, [1, 2])], num_scheduled_tokens={"c": 12})
    assert first == {}
    rest = CachedRequestData("c", [], 12)
    assert step(worker, cached_requests=[rest], num_scheduled_tokens={"c": 8}) == {"c": expected}
    step(worker, finished_request_ids=["c"])


def test_a_resumed_request_takes_its_new_block_table_and_recomputes(worker, reference):
    prompt = [8, 9, 10, 11]
    expected = hf_greedy(reference, prompt, 2)
    sampled = step(worker, new_requests=[new("r", prompt, [5])], num_scheduled_tokens={"r": 4})
    assert sampled == {"r": expected[:1]}
    # Preempted, then re-admitted in other blocks: all 5 known tokens computed again.
    resumed = CachedRequestData("r", [9], 0, is_resumed=True, new_token_ids=prompt + sampled["r"])
    again = step(worker, cached_requests=[resumed], num_scheduled_tokens={"r": 5})
    assert worker.runner.requests["r"].block_ids == [9]
    assert again == {"r": expected[1:]}
    step(worker, finished_request_ids=["r"])


def test_a_batch_samples_each_request_as_alone(worker, reference):
    prompts = {"a": [1, 2, 3], "b": [50, 60, 70, 80, 90, 100]}
    expected = {rid: hf_greedy(reference, p, 1) for rid, p in prompts.items()}
    news = [new("a", prompts["a"], [10]), new("b", prompts["b"], [11])]
    sampled = step(worker, new_requests=news, num_scheduled_tokens={"a": 3, "b": 6})
    assert sampled == expected
    step(worker, finished_request_ids=["a", "b"])


def test_the_worker_reports_what_it_resolved_and_holds(worker):
    assert worker.attention_backend_name in worker.registry.names("attention_backend")
    memory = worker.memory_report()
    assert memory.weights_bytes > 0 and memory.kv_cache_block_bytes > 0
    assert worker.determine_num_kv_blocks() == 16
    assert worker.longest_sequence() == 16 * BLOCK_SIZE  # the cache bounds the RoPE tables


def test_a_kv_cache_budget_that_holds_no_block_is_refused_naming_the_setting(folder):
    config = VliteConfig(model=str(folder), kv_cache_memory_gib=1e-9, enforce_eager=True)
    worker = Worker(config, PluginRegistry(build_plugin_manager()))
    worker.load_model()
    with pytest.raises(ConfigError, match="kv_cache_memory_gib=1e-09: a budget of"):
        worker.determine_num_kv_blocks()


def test_the_kv_cache_is_sized_for_kv_cache_tokens(folder):
    config = VliteConfig(model=str(folder), kv_cache_tokens=100, block_size=BLOCK_SIZE)
    worker = Worker(config, PluginRegistry(build_plugin_manager()))
    worker.load_model()
    assert worker.determine_num_kv_blocks() == 7  # ceil(100 / 16)
    assert worker.longest_sequence() == 112


def test_using_the_runner_before_load_model_is_a_bug_not_a_config_error(folder):
    worker = Worker(VliteConfig(model=str(folder)), PluginRegistry(build_plugin_manager()))
    with pytest.raises(RuntimeError, match="load_model"):
        worker.execute_model(scheduler_output())
