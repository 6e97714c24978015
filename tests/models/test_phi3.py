"""Phi-3: fused checkpoint projections, partial rotary, and what is refused."""

from __future__ import annotations

import json

import pytest

from vlite import LLM
from vlite.core.plugins import PluginRegistry, build_plugin_manager
from vlite.models.phi3 import ARCHITECTURE, Phi3ForCausalLM
from vlite.testing.tiny_models import make_tiny_model


def test_the_architecture_is_a_built_in_model_plugin():
    registry = PluginRegistry(build_plugin_manager(load_entry_points=False))
    assert registry.get("model", ARCHITECTURE) is Phi3ForCausalLM


def test_longrope_is_refused_naming_it(tmp_path):
    folder = make_tiny_model(tmp_path / "phi3", ARCHITECTURE)
    config_path = folder / "config.json"
    config = json.loads(config_path.read_text())
    head = config["hidden_size"] // config["num_attention_heads"]
    config["rope_parameters"] = {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.5,
        "short_factor": [1.0] * (head // 4),
        "long_factor": [2.0] * (head // 4),
        "original_max_position_embeddings": 256,
    }
    config_path.write_text(json.dumps(config))
    with pytest.raises(ValueError, match="rope_type='longrope' is not supported"):
        LLM(model=str(folder))


def test_a_fused_matrix_of_the_wrong_size_is_refused(tmp_path):
    import torch

    from vlite.models.loader import load_hf_config
    from vlite.plugins.attention.torch_ref import TorchAttentionBackend

    folder = make_tiny_model(tmp_path / "phi3", ARCHITECTURE)
    model = Phi3ForCausalLM(load_hf_config(folder), TorchAttentionBackend, 16)
    hidden = model.config.hidden_size
    bad = torch.zeros(hidden + 8, hidden)  # not q + k + v rows
    with pytest.raises(ValueError, match="qkv_proj.weight' has 72 rows, expected 128"):
        model.load_weights([("model.layers.0.self_attn.qkv_proj.weight", bad)])
