"""Qwen2-MoE and Qwen3-MoE: Qwen2/Qwen3 attention with a mixture of experts.

A layer's feed-forward is :class:`QwenMoE` — a router (``mlp.gate``), ``num_experts``
SwiGLU experts of ``moe_intermediate_size`` run by
:class:`~vlite.models.fused_moe.FusedMoE` (top-k weights renormalized when
``norm_topk_prob``), and, in Qwen2-MoE, a shared expert every token goes through, scaled by
``sigmoid(shared_expert_gate(x))`` — or a dense MLP in the layers ``mlp_only_layers`` names
or ``decoder_sparse_step`` skips. Checkpoint names: ``mlp.experts.{e}.gate_proj/up_proj/
down_proj``, ``mlp.shared_expert.*``, ``mlp.shared_expert_gate``.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from vlite.core.hookspecs import Register, hookimpl
from vlite.distributed.parallel_state import SINGLE_RANK, TensorParallelGroup
from vlite.models.fused_moe import FusedMoE, MoEBlock
from vlite.models.gguf_names import LLAMA_LAYER_MODULES, PROJ_EXPERTS, QWEN_MOE_MODULES
from vlite.models.llama import LlamaForCausalLM, LlamaMLP, check_tensor_parallel_size

ARCHITECTURES = ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")

_EXPERT_WEIGHT = re.compile(
    r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$"
)


def is_sparse_layer(config: Any, index: int) -> bool:
    """Whether layer ``index`` has experts (else a dense MLP)."""
    if index in (getattr(config, "mlp_only_layers", None) or []):
        return False
    step = getattr(config, "decoder_sparse_step", 1) or 1
    return config.num_experts > 0 and (index + 1) % step == 0


class QwenMoE(MoEBlock):
    """Router, experts and (when configured) the shared expert of one layer.

    ``expert_size`` is one expert's inner width: ``moe_intermediate_size`` unless given
    (OLMoE's experts use ``intermediate_size``).
    """

    def __init__(
        self,
        config: Any,
        tp_group: TensorParallelGroup = SINGLE_RANK,
        expert_size: int | None = None,
    ) -> None:
        super().__init__(
            config.hidden_size,
            config.num_experts,
            config.num_experts_per_tok,
            expert_size or config.moe_intermediate_size,
            renormalize=bool(getattr(config, "norm_topk_prob", False)),
            tp_group=tp_group,
        )
        shared_size = getattr(config, "shared_expert_intermediate_size", 0) or 0
        self.shared_expert = LlamaMLP(config, tp_group, shared_size) if shared_size else None
        self.shared_expert_gate = (
            nn.Linear(config.hidden_size, 1, bias=False) if shared_size else None
        )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        out = super().forward(hidden)
        if self.shared_expert is not None:
            shared = self.shared_expert(hidden)
            out = out + torch.sigmoid(self.shared_expert_gate(hidden)) * shared
        return out


class QwenMoeForCausalLM(LlamaForCausalLM):
    """:class:`~vlite.models.llama.LlamaForCausalLM` with :class:`QwenMoE` feed-forwards."""

    #: The router's, the shared expert's and the experts' GGUF names.
    gguf_layer_modules = {**LLAMA_LAYER_MODULES, **QWEN_MOE_MODULES}
    gguf_expert_names = PROJ_EXPERTS

    @staticmethod
    def make_mlp(config: Any, tp_group: TensorParallelGroup, layer_index: int) -> nn.Module:
        if is_sparse_layer(config, layer_index):
            return QwenMoE(config, tp_group)
        return LlamaMLP(config, tp_group)

    @classmethod
    def check_tensor_parallel_size(cls, hf_config: Any, tensor_parallel_size: int) -> None:
        """Heads, KV heads, whole experts and the dense and shared MLPs split over the ranks."""
        split = {
            "num_experts": hf_config.num_experts,
            "intermediate_size": hf_config.intermediate_size,
        }
        shared = getattr(hf_config, "shared_expert_intermediate_size", 0) or 0
        if shared:
            split["shared_expert_intermediate_size"] = shared
        check_tensor_parallel_size(hf_config, tensor_parallel_size, split)

    def load_own_weight(self, hf_name: str, tensor: torch.Tensor) -> bool:
        match = _EXPERT_WEIGHT.match(hf_name)
        if match is None:
            return False
        layer, expert, piece = int(match[1]), int(match[2]), match[3]
        self.model.layers[layer].mlp.experts.load_expert(expert, piece, tensor)
        return True

    def own_missing_weights(self) -> list[str]:
        return [
            f"model.layers.{index}.mlp {missing}"
            for index, layer in self.local_layers()
            if isinstance(getattr(layer.mlp, "experts", None), FusedMoE)
            for missing in layer.mlp.experts.missing_weights()
        ]


@hookimpl
def register_models(register: Register) -> None:
    for architecture in ARCHITECTURES:
        register(architecture, QwenMoeForCausalLM)
