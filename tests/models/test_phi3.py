"""Phi-3: fused checkpoint projections and what is refused (LongRoPE: test_phi3_longrope)."""

from __future__ import annotations

import pytest

from vlite.core.plugins import PluginRegistry, build_plugin_manager
from vlite.models.phi3 import ARCHITECTURE, Phi3ForCausalLM
from vlite.testing.tiny_models import make_tiny_model


def test_the_architecture_is_a_built_in_model_plugin():
    registry = PluginRegistry(build_plugin_manager(load_entry_points=False))
    assert registry.get("model", ARCHITECTURE) is Phi3ForCausalLM


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
