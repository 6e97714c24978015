"""OLMoE: a mixture of experts with RMSNorm over the whole query and key projections.

OLMoE's layers are Llama's with two changes: the feed-forward is a mixture of
``num_experts`` SwiGLU experts of ``intermediate_size`` (top ``num_experts_per_tok``, weights
renormalized when ``norm_topk_prob``), loaded as Qwen-MoE's are (``mlp.gate``,
``mlp.experts.{e}.gate_proj/up_proj/down_proj``); and attention normalizes the full query
and key projections (``q_norm`` over all heads, ``k_norm`` over all KV heads) before RoPE,
optionally clamping q, k and v to ``clip_qkv``. A norm over all heads would need the other
ranks' heads, so OLMoE runs at tensor-parallel size 1.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from vlite.core.attention import AttentionMetadata
from vlite.core.errors import ConfigError
from vlite.core.hookspecs import Register, hookimpl
from vlite.distributed.parallel_state import TensorParallelGroup
from vlite.models.llama import LlamaAttention, LlamaMLP, RMSNorm
from vlite.models.qwen_moe import QwenMoE, QwenMoeForCausalLM, is_sparse_layer
from vlite.models.rope import StepRotation

ARCHITECTURE = "OlmoeForCausalLM"


class OlmoeAttention(LlamaAttention):
    """Llama attention with q/k RMSNorm over the full projections, and ``clip_qkv``."""

    def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, *args, **kwargs)
        self.q_norm = RMSNorm(self.q_size, config.rms_norm_eps)
        self.k_norm = RMSNorm(self.kv_size, config.rms_norm_eps)
        self.clip_qkv: float | None = getattr(config, "clip_qkv", None)

    def forward(
        self,
        rotation: StepRotation,
        hidden: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], -1)
        q, k = self.q_norm(q), self.k_norm(k)
        if self.clip_qkv is not None:
            q, k, v = (t.clamp(-self.clip_qkv, self.clip_qkv) for t in (q, k, v))
        q = q.reshape(num_tokens, self.num_heads, self.head_dim)
        k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        if self.use_rope:
            q, k = rotation.rotate(q), rotation.rotate(k)
        out = self.attend(q, k, v, kv_cache, metadata)
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class OlmoeForCausalLM(QwenMoeForCausalLM):
    """OLMoE: :class:`OlmoeAttention` and Qwen-MoE's experts in the Llama decoder."""

    supports_tensor_parallel = False
    attention_class = OlmoeAttention

    @staticmethod
    def make_mlp(config: Any, tp_group: TensorParallelGroup, layer_index: int) -> nn.Module:
        if is_sparse_layer(config, layer_index):  # experts of intermediate_size, no shared one
            return QwenMoE(config, tp_group, expert_size=config.intermediate_size)
        return LlamaMLP(config, tp_group)

    @classmethod
    def check_tensor_parallel_size(cls, hf_config: Any, tensor_parallel_size: int) -> None:
        if tensor_parallel_size != 1:
            raise ConfigError(
                f"olmoe: tensor_parallel_size={tensor_parallel_size} is not supported: its "
                "q/k norms span every head; this model supports tensor_parallel_size in {1}"
            )


@hookimpl
def register_models(register: Register) -> None:
    register(ARCHITECTURE, OlmoeForCausalLM)
