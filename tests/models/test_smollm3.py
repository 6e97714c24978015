"""SmolLM3: Llama with NoPE layers, registered as its own model plugin."""

from __future__ import annotations

import json
import shutil
from types import SimpleNamespace

import pytest

from vlite import LLM
from vlite.core.plugins import PluginRegistry, build_plugin_manager
from vlite.models.smollm3 import ARCHITECTURE, SmolLM3ForCausalLM, rope_layers
from vlite.testing.tiny_models import make_tiny_model


def config(**fields) -> SimpleNamespace:
    return SimpleNamespace(num_hidden_layers=8, **fields)


def test_no_rope_layers_are_read_from_the_config_or_derived_from_the_interval():
    assert rope_layers(config(no_rope_layers=[1, 0, 1, 1, 1, 0, 1, 1])) == [
        True, False, True, True, True, False, True, True,
    ]  # fmt: skip
    assert rope_layers(config()) == [True, True, True, False] * 2
    assert rope_layers(config(no_rope_layer_interval=2)) == [True, False] * 4


def test_a_no_rope_list_of_the_wrong_length_is_refused():
    with pytest.raises(ValueError, match="3 entries for 8 layers"):
        rope_layers(config(no_rope_layers=[1, 1, 0]))


def test_the_architecture_is_a_built_in_model_plugin():
    registry = PluginRegistry(build_plugin_manager(load_entry_points=False))
    entry = registry.entry("model", ARCHITECTURE)
    assert entry.obj is SmolLM3ForCausalLM and entry.plugin_name == "vlite.models.smollm3"


def test_an_unsupported_architecture_lists_the_supported_ones_and_the_hook(tmp_path):
    folder = make_tiny_model(tmp_path / "tiny", "LlamaForCausalLM")
    odd = shutil.copytree(folder, tmp_path / "odd")
    config_path = odd / "config.json"
    fields = json.loads(config_path.read_text())
    fields["architectures"] = ["MadeUpForCausalLM"]
    config_path.write_text(json.dumps(fields))

    with pytest.raises(ValueError) as info:
        LLM(model=str(odd))
    message = str(info.value)
    assert "'MadeUpForCausalLM'" in message and "register_models" in message
    assert "LlamaForCausalLM" in message and ARCHITECTURE in message
