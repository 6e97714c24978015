"""The tiny-model helpers make any architecture transformers knows, not only vlite's own."""

from __future__ import annotations

import json

import pytest

from vlite.testing.tiny_models import make_tiny_model


def test_an_architecture_vlite_does_not_ship_gets_a_tiny_model(tmp_path):
    folder = make_tiny_model(tmp_path / "granite", "GraniteForCausalLM")
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["GraniteForCausalLM"]
    assert config["model_type"] == "granite" and config["num_hidden_layers"] == 2
    assert (folder / "tokenizer.json").exists()


def test_an_architecture_transformers_does_not_know_is_named():
    with pytest.raises(ValueError, match="no NoSuchConfig for architecture 'NoSuchForCausalLM'"):
        make_tiny_model("unused", "NoSuchForCausalLM")
