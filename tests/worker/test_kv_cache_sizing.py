"""How a worker sizes its KV cache, and the memory plan the engine core reports."""

from __future__ import annotations

import types

import pytest
import torch
from torch import nn

from vlite.core.config import VliteConfig
from vlite.core.engine_core import EngineCore
from vlite.core.errors import ConfigError
from vlite.core.plugins import PluginRegistry, build_plugin_manager
from vlite.models.spec import ModelSpec
from vlite.testing.engine_runs import cached_tiny_model
from vlite.worker.worker import Worker, model_weights_bytes

_GIB = 1 << 30
#: The tiny Llama's block: 2 layers x (keys, values) x 16 slots x 2 KV heads x 16 x float32.
BLOCK_BYTES = 2 * 2 * 16 * 2 * 16 * 4
#: 512 positions in blocks of 16.
BLOCKS_PER_SEQUENCE = 32


@pytest.fixture(scope="module")
def model() -> str:
    return str(cached_tiny_model("LlamaForCausalLM"))


@pytest.fixture(scope="module")
def registry() -> PluginRegistry:
    return PluginRegistry(build_plugin_manager(load_entry_points=False))


def loaded_worker(model: str, registry: PluginRegistry, **settings) -> Worker:
    worker = Worker(VliteConfig(model=model, device="cpu", **settings), registry)
    worker.load_model()
    return worker


def test_a_block_holds_keys_and_values_of_every_layer(model, registry):
    assert loaded_worker(model, registry).kv_cache_bytes_per_block() == BLOCK_BYTES


def test_by_default_every_sequence_at_full_length_within_the_budget(model, registry):
    # What vlite serve and LLM(...) get: max_num_seqs sequences of max_model_len tokens,
    # unless the budget holds less (2 GiB on CPU holds 262,144 blocks of this model).
    worker = loaded_worker(model, registry)
    assert worker.determine_num_kv_blocks() == 256 * BLOCKS_PER_SEQUENCE
    worker = loaded_worker(model, registry, max_num_seqs=4)
    assert worker.determine_num_kv_blocks() == 4 * BLOCKS_PER_SEQUENCE
    worker = loaded_worker(model, registry, kv_cache_memory_gib=100 * BLOCK_BYTES / _GIB)
    assert worker.determine_num_kv_blocks() == 100


def test_kv_cache_tokens_sizes_the_cache_within_the_budget(model, registry):
    assert loaded_worker(model, registry, kv_cache_tokens=40).determine_num_kv_blocks() == 3
    assert loaded_worker(model, registry, kv_cache_tokens=48).determine_num_kv_blocks() == 3
    budget = 2 * BLOCK_BYTES / _GIB
    worker = loaded_worker(model, registry, kv_cache_tokens=40, kv_cache_memory_gib=budget)
    assert worker.determine_num_kv_blocks() == 2


def test_num_kv_blocks_is_exact(model, registry):
    worker = loaded_worker(model, registry, num_kv_blocks=7, kv_cache_tokens=16)
    assert worker.determine_num_kv_blocks() == 7


def test_a_budget_that_holds_no_block_is_a_config_error_naming_it(model, registry):
    worker = loaded_worker(model, registry, kv_cache_memory_gib=BLOCK_BYTES / 2 / _GIB)
    with pytest.raises(ConfigError) as error:
        worker.determine_num_kv_blocks()
    message = str(error.value)
    assert message.startswith("kv_cache_memory_gib=")
    assert f"holds no KV-cache block of {BLOCK_BYTES} bytes" in message
    assert f"allowed: kv_cache_memory_gib >= {BLOCK_BYTES / _GIB:.6f}" in message
    assert isinstance(error.value, ValueError)


# ---- the weights' bytes ------------------------------------------------------------------


class _Holder(nn.Module):
    def __init__(self, quantized) -> None:
        super().__init__()
        self.quantized = quantized


def test_weights_are_parameters_buffers_and_quantized_objects_each_once():
    with_nbytes = types.SimpleNamespace(nbytes=1000, blocks=torch.zeros(7, dtype=torch.uint8))
    blocks_only = types.SimpleNamespace(blocks=torch.zeros(256, dtype=torch.uint8))
    model = nn.Module()
    model.linear = nn.Linear(4, 3)  # 12 + 3 float32: 60 bytes
    model.register_buffer("table", torch.zeros(10))  # 40 bytes
    model.a = _Holder(with_nbytes)  # its nbytes, not its blocks'
    model.b = _Holder(blocks_only)  # no nbytes: its blocks'
    model.c = _Holder(with_nbytes)  # shared (tied): counted once
    model.d = _Holder(None)
    model.tied = model.linear  # a shared module's parameters count once too
    assert model_weights_bytes(model) == 60 + 40 + 1000 + 256


# ---- the engine core's plan ----------------------------------------------------------------


def _core(registry: PluginRegistry, **settings) -> EngineCore:
    config = VliteConfig(device="cpu", **settings)
    return EngineCore(config, ModelSpec.from_config(config), registry)


def test_the_plan_is_what_the_worker_allocated(model, registry):
    core = _core(registry, model=model, num_kv_blocks=7)
    try:
        plan = core.memory_plan
        runner = core.executor.worker.runner
        assert plan.kv_cache_blocks == core.kv_cache_manager.num_blocks == 7
        assert plan.kv_cache_block_bytes == BLOCK_BYTES
        assert plan.kv_cache_bytes == 7 * BLOCK_BYTES == sum(t.nbytes for t in runner.kv_caches)
        assert plan.kv_cache_tokens == 7 * 16
        parameters = sum(p.nbytes for p in runner.model.parameters())
        buffers = sum(b.nbytes for b in runner.model.buffers())
        assert plan.weights_bytes == parameters + buffers > 0
        assert plan.num_workers == 1
    finally:
        core.shutdown()


def test_a_quantized_models_weights_are_its_blocks_besides_its_tensors(registry, tmp_path):
    from vlite.testing.tiny_gguf import write_tiny_gguf
    from vlite.testing.tiny_models import make_tiny_model

    folder = make_tiny_model(tmp_path / "hf", "LlamaForCausalLM")
    path = write_tiny_gguf(folder, tmp_path / "tiny.gguf", quantize=("Q4_1", "Q8_0"))
    core = _core(registry, model=str(path), num_kv_blocks=4)
    try:
        model = core.executor.worker.runner.model
        quantized = {
            id(m.quantized): m.quantized
            for m in model.modules()
            if getattr(m, "quantized", None) is not None
        }
        assert quantized, "the tiny GGUF file's matrices stay quantized"
        quantized_bytes = sum(
            getattr(q, "nbytes", None) or q.blocks.nbytes for q in quantized.values()
        )
        tensors = sum(t.nbytes for t in (*model.parameters(), *model.buffers()))
        assert core.memory_plan.weights_bytes == tensors + quantized_bytes
    finally:
        core.shutdown()
