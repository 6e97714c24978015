"""An outside-style model plugin: Granite as the Llama decoder with Granite's four
multipliers, through the Llama hooks (the example of docs/models.md)."""

from __future__ import annotations

from typing import Any

import vlite
from vlite.models.llama import LlamaForCausalLM


class GraniteForCausalLM(LlamaForCausalLM):
    """IBM Granite (3.x): Llama with scaled embeddings, attention scores, residual
    branches and logits, each read from the Hugging Face config."""

    #: What ModelConformance (and ``vlite plugins check``) builds its tiny model with:
    #: multipliers other than 1.0, so that each hook is exercised.
    tiny_config = {
        "embedding_multiplier": 2.0,
        "attention_multiplier": 0.1,
        "residual_multiplier": 0.5,
        "logits_scaling": 4.0,
    }

    @classmethod
    def attention_scale(cls, hf_config: Any) -> float:
        return hf_config.attention_multiplier

    @classmethod
    def embedding_multiplier(cls, hf_config: Any) -> float:
        return hf_config.embedding_multiplier

    @classmethod
    def residual_multiplier(cls, hf_config: Any) -> float:
        return hf_config.residual_multiplier

    @classmethod
    def logits_scaling(cls, hf_config: Any) -> float:
        return hf_config.logits_scaling


@vlite.hookimpl
def register_models(register):
    register("GraniteForCausalLM", GraniteForCausalLM)
