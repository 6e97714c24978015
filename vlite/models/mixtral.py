"""Mixtral: the Llama decoder with a mixture of SwiGLU experts in place of each MLP.

Each layer's feed-forward is :func:`mixtral_moe`: a router (``gate``, ``[num_experts,
hidden]``, replicated on every rank) picks ``num_experts_per_tok`` experts per token, and
:class:`~vlite.models.fused_moe.FusedMoE` runs them grouped by expert (whole experts per
tensor-parallel rank). Checkpoints name the parts ``block_sparse_moe.gate`` and
``block_sparse_moe.experts.{e}.w1/w3/w2`` (gate, up, down); ``sliding_window`` windows
every layer, as for Mistral.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from vlite.core.hookspecs import Register, hookimpl
from vlite.distributed.parallel_state import SINGLE_RANK, TensorParallelGroup
from vlite.models.fused_moe import MoEBlock
from vlite.models.gguf_names import LLAMA_LAYER_MODULES, MIXTRAL_EXPERTS, MIXTRAL_MODULES
from vlite.models.llama import LlamaForCausalLM, check_tensor_parallel_size

ARCHITECTURE = "MixtralForCausalLM"

#: ``model.layers.3.block_sparse_moe.experts.5.w1.weight`` -> layer 3, expert 5, w1.
_EXPERT_WEIGHT = re.compile(
    r"^model\.layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.(w[123])\.weight$"
)
_PIECE_OF = {"w1": "gate", "w3": "up", "w2": "down"}


def mixtral_moe(config: Any, tp_group: TensorParallelGroup = SINGLE_RANK) -> MoEBlock:
    """One layer's router and experts (top-k weights always renormalized)."""
    return MoEBlock(
        config.hidden_size,
        config.num_local_experts,
        config.num_experts_per_tok,
        config.intermediate_size,
        renormalize=True,
        tp_group=tp_group,
    )


class MixtralForCausalLM(LlamaForCausalLM):
    """:class:`~vlite.models.llama.LlamaForCausalLM` with a mixture of experts
    (:func:`mixtral_moe`) as every layer's feed-forward."""

    #: The router's GGUF name (the experts' come from :attr:`gguf_expert_names`).
    gguf_layer_modules = {**LLAMA_LAYER_MODULES, **MIXTRAL_MODULES}
    gguf_expert_names = MIXTRAL_EXPERTS

    @staticmethod
    def make_mlp(config: Any, tp_group: TensorParallelGroup, layer_index: int) -> nn.Module:
        return mixtral_moe(config, tp_group)

    @classmethod
    def check_tensor_parallel_size(cls, hf_config: Any, tensor_parallel_size: int) -> None:
        """Heads and KV heads split over the ranks, and whole experts do."""
        experts = {"num_local_experts": hf_config.num_local_experts}
        check_tensor_parallel_size(hf_config, tensor_parallel_size, experts)

    def load_own_weight(self, hf_name: str, tensor: torch.Tensor) -> bool:
        match = _EXPERT_WEIGHT.match(hf_name)
        if match is None:
            return False
        layer, expert, matrix = int(match[1]), int(match[2]), match[3]
        self.model.layers[layer].mlp.experts.load_expert(expert, _PIECE_OF[matrix], tensor)
        return True

    def own_missing_weights(self) -> list[str]:
        return [
            f"model.layers.{index}.block_sparse_moe {missing}"
            for index, layer in self.local_layers()
            for missing in layer.mlp.experts.missing_weights()
        ]

    def load_weights(self, weights) -> None:
        # The router's checkpoint name: block_sparse_moe.gate -> mlp.gate.
        renamed = (
            (name.replace(".block_sparse_moe.gate.", ".mlp.gate."), tensor)
            for name, tensor in weights
        )
        super().load_weights(renamed)


@hookimpl
def register_models(register: Register) -> None:
    register(ARCHITECTURE, MixtralForCausalLM)
