"""Qwen2-MoE / Qwen3-MoE: which layers have experts, the shared expert, registration."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from safetensors.torch import load_file

from vlite.core.plugins import PluginRegistry, build_plugin_manager
from vlite.models.llama import LlamaMLP
from vlite.models.loader import load_hf_config
from vlite.models.qwen_moe import ARCHITECTURES, QwenMoE, QwenMoeForCausalLM, is_sparse_layer
from vlite.plugins.attention.torch_ref import TorchAttentionBackend
from vlite.testing.tiny_models import make_tiny_model


def test_both_architectures_are_built_in_model_plugins():
    registry = PluginRegistry(build_plugin_manager(load_entry_points=False))
    assert all(registry.get("model", name) is QwenMoeForCausalLM for name in ARCHITECTURES)


def test_sparse_layers_follow_the_step_and_skip_the_mlp_only_ones():
    config = SimpleNamespace(num_experts=8, decoder_sparse_step=2, mlp_only_layers=[3])
    assert [is_sparse_layer(config, i) for i in range(6)] == [
        False, True, False, False, False, True,
    ]  # fmt: skip
    assert not is_sparse_layer(SimpleNamespace(num_experts=0), 0)


def test_the_tiny_qwen2_moe_has_a_shared_expert_and_a_dense_layer(tmp_path):
    folder = make_tiny_model(tmp_path / "q2moe", "Qwen2MoeForCausalLM", num_kv_heads=2)
    model = QwenMoeForCausalLM(load_hf_config(folder), TorchAttentionBackend, 16)
    first, second = (layer.mlp for layer in model.model.layers)
    assert isinstance(first, QwenMoE) and first.shared_expert is not None
    assert type(second) is LlamaMLP
    weights = load_file(folder / "model.safetensors")
    del weights["model.layers.0.mlp.experts.3.down_proj.weight"]
    with pytest.raises(ValueError, match="model.layers.0.mlp expert 3 down"):
        model.load_weights(weights.items())
