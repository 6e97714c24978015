"""OLMoE: full-width q/k norms (so tensor parallelism is refused), registration."""

from __future__ import annotations

import pytest

from vlite.core.plugins import PluginRegistry, build_plugin_manager
from vlite.models.loader import load_hf_config
from vlite.models.olmoe import ARCHITECTURE, OlmoeAttention, OlmoeForCausalLM
from vlite.plugins.attention.torch_ref import TorchAttentionBackend
from vlite.testing.tiny_models import make_tiny_model


def test_the_architecture_is_a_built_in_model_plugin():
    registry = PluginRegistry(build_plugin_manager(load_entry_points=False))
    assert registry.get("model", ARCHITECTURE) is OlmoeForCausalLM


def test_its_norms_span_every_head_so_tensor_parallelism_is_refused(tmp_path):
    folder = make_tiny_model(tmp_path / "olmoe", ARCHITECTURE, num_kv_heads=2)
    config = load_hf_config(folder)
    model = OlmoeForCausalLM(config, TorchAttentionBackend, 16)
    attention = model.model.layers[0].self_attn
    assert isinstance(attention, OlmoeAttention)
    assert attention.q_norm.weight.shape == (config.hidden_size,)  # all heads, not one
    assert attention.clip_qkv == 2.0
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 is not supported"):
        OlmoeForCausalLM.check_tensor_parallel_size(config, 2)
