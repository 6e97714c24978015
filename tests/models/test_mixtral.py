"""Mixtral: experts loaded from the checkpoint's per-expert names, split whole over ranks."""

from __future__ import annotations

import pytest
from safetensors.torch import load_file

from vlite.core.plugins import PluginRegistry, build_plugin_manager
from vlite.models.loader import load_hf_config
from vlite.models.mixtral import ARCHITECTURE, MixtralForCausalLM
from vlite.plugins.attention.torch_ref import TorchAttentionBackend
from vlite.testing.tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("mixtral"), ARCHITECTURE, num_kv_heads=2)


def test_the_architecture_is_a_built_in_model_plugin():
    registry = PluginRegistry(build_plugin_manager(load_entry_points=False))
    assert registry.get("model", ARCHITECTURE) is MixtralForCausalLM


def test_tensor_parallel_sizes_must_split_heads_and_whole_experts(folder):
    config = load_hf_config(folder)  # 4 heads, 2 KV heads, 4 experts
    MixtralForCausalLM.check_tensor_parallel_size(config, 2)
    with pytest.raises(ValueError, match=r"num_local_experts=4.*supports tensor_parallel_size"):
        config.num_key_value_heads = 3
        MixtralForCausalLM.check_tensor_parallel_size(config, 3)


def test_a_checkpoint_missing_an_expert_matrix_is_refused_naming_it(folder):
    weights = load_file(folder / "model.safetensors")
    del weights["model.layers.1.block_sparse_moe.experts.2.w3.weight"]
    model = MixtralForCausalLM(load_hf_config(folder), TorchAttentionBackend, 16)
    with pytest.raises(ValueError, match="model.layers.1.block_sparse_moe expert 2 up"):
        model.load_weights(weights.items())
