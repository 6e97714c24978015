"""Deliberately wrong Granite models, each a plugin object registering
``GraniteForCausalLM``, for the tests that ModelConformance catches them."""

from __future__ import annotations

from typing import Any

import torch
from granite_plugin import GraniteForCausalLM

import vlite
from vlite.models.llama import LlamaForCausalLM


class NoisyGranite(GraniteForCausalLM):
    """Granite whose logits carry a fixed pattern of noise of amplitude 0.1."""

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden_states)
        ids = torch.arange(logits.shape[-1], device=logits.device, dtype=logits.dtype)
        return logits + 0.1 * torch.sin(ids * 12.9898)


class UnscaledLogitsGranite(GraniteForCausalLM):
    """Granite without the division by ``logits_scaling``: the greedy tokens are right,
    the log-probabilities are not."""

    @classmethod
    def logits_scaling(cls, hf_config: Any) -> float:
        return 1.0


class SwappedLayersGranite(GraniteForCausalLM):
    """Granite running its two layers in the wrong order."""

    def load_weights(self, weights) -> None:
        super().load_weights(weights)
        layers = self.model.layers
        layers[0], layers[1] = layers[1], layers[0]


class _Registers:
    """A plugin object registering ``model_cls`` as ``GraniteForCausalLM``."""

    def __init__(self, model_cls: type) -> None:
        self.model_cls = model_cls

    @vlite.hookimpl
    def register_models(self, register) -> None:
        register("GraniteForCausalLM", self.model_cls)


#: Llama's defaults for every hook: Granite's multipliers ignored.
ignores_multipliers = _Registers(LlamaForCausalLM)
noisy_logits = _Registers(NoisyGranite)
unscaled_logits = _Registers(UnscaledLogitsGranite)
swapped_layers = _Registers(SwappedLayersGranite)
