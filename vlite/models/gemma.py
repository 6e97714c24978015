"""Gemma 2 and Gemma 3 (text): the Llama decoder reshaped, as a model plugin.

What differs from :mod:`vlite.models.llama`, all read from the Hugging Face config:

- embeddings are scaled by ``sqrt(hidden_size)`` (in the hidden dtype, as transformers);
- every RMSNorm multiplies by ``1 + weight`` (weights stored centred on 0), in float32;
- each block is "sandwiched": ``x + post_attn_norm(attn(input_norm(x)))`` then
  ``x + post_ffw_norm(mlp(pre_ffw_norm(x)))``, four norms per layer;
- the feed-forward is GeGLU: ``down(gelu_tanh(gate) * up)``;
- attention scores are scaled by ``query_pre_attn_scalar ** -0.5``, not ``head_dim ** -0.5``;
- Gemma 2 caps attention scores (``attn_logit_softcapping``, passed to the backend as
  ``logits_soft_cap``) and the final logits (``final_logit_softcapping``) at ``cap *
  tanh(x / cap)``;
- layers alternate local (``sliding_attention``, windowed) and global attention
  (``layer_types``; Gemma 2 every other layer, Gemma 3 five local to one global);
- Gemma 3 normalises queries and keys per head (``q_norm``/``k_norm``) and rotates local
  layers with their own RoPE base (``rope_local_base_freq``, unscaled) and global layers
  with ``rope_theta`` and its scaling (``linear`` for the larger checkpoints).

Tensor parallelism splits heads and GeGLU features as for Llama (the norms, q/k norms
included, are per head or replicated); pipeline stages split the layers as for Llama, a
stage handing the next only the residual stream. GGUF files (llama.cpp's ``gemma2``/``gemma3``) load
through :mod:`vlite.models.gguf`, which undoes the converter's ``+1`` on norm weights.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vlite.core.attention import AttentionBackend, AttentionMetadata
from vlite.core.hookspecs import Register, hookimpl
from vlite.distributed.parallel_state import SINGLE_RANK, TensorParallelGroup
from vlite.distributed.pipeline import SINGLE_STAGE, PipelineParallelGroup
from vlite.models.gguf_names import GEMMA_MODULES, LLAMA_LAYER_MODULES
from vlite.models.llama import (
    LlamaAttention,
    LlamaForCausalLM,
    LlamaMLP,
    PipelineMissingLayer,
)
from vlite.models.parallel_layers import VocabEmbedding
from vlite.models.rope import RotaryEmbedding, StepRotation
from vlite.models.spec import layer_sliding_windows

ARCHITECTURES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
_ACTIVATIONS = ("gelu_pytorch_tanh", "gelu_tanh")


class GemmaRMSNorm(nn.Module):
    """RMSNorm scaled by ``1 + weight``, computed in float32 and cast back (as Gemma)."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., size]`` -> normed ``[..., size]`` in ``x.dtype``."""
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).to(x.dtype)


class GemmaMLP(LlamaMLP):
    """GeGLU feed-forward: ``down(gelu_tanh(gate) * up)`` with a fused gate/up projection."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, hidden_size]`` -> ``[T, hidden_size]``."""
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class GemmaAttention(LlamaAttention):
    """Llama's attention with Gemma 3's per-head q/k norms (when ``qk_norm``) and the
    layer's own rotary table (local or global)."""

    def __init__(
        self,
        config: Any,
        attention: AttentionBackend,
        rotary: RotaryEmbedding,
        qk_norm: bool,
        tp_group: TensorParallelGroup = SINGLE_RANK,
    ):
        super().__init__(config, attention, rotary, tp_group)
        self.has_gemma_qk_norm = qk_norm
        if qk_norm:
            self.q_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = GemmaRMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(
        self,
        rotation: StepRotation,
        hidden: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """``hidden`` ``[T, hidden_size]`` -> ``[T, hidden_size]``, rotated by ``rotation``
        (the step's positions in this layer's RoPE table)."""
        num_tokens = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], -1)
        q = q.reshape(num_tokens, self.num_heads, self.head_dim)
        k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        if self.has_gemma_qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotation.rotate(q), rotation.rotate(k)
        out = self.attend(q, k, v, kv_cache, metadata)  # [T, heads, head_dim]
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class GemmaDecoderLayer(nn.Module):
    """The sandwiched block: four norms around attention and the feed-forward."""

    def __init__(
        self,
        config: Any,
        self_attn: GemmaAttention,
        local: bool,
        tp_group: TensorParallelGroup = SINGLE_RANK,
    ):
        super().__init__()
        self.self_attn = self_attn
        self.mlp = GemmaMLP(config, tp_group)
        eps = config.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(config.hidden_size, eps)
        #: Whether the layer is local (windowed, Gemma 3's local RoPE base).
        self.local = local

    def forward(
        self,
        rotation: StepRotation,
        hidden: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """``[T, hidden_size]`` -> ``[T, hidden_size]`` (the residual stream)."""
        attended = self.self_attn(rotation, self.input_layernorm(hidden), kv_cache, metadata)
        hidden = hidden + self.post_attention_layernorm(attended)
        fed = self.mlp(self.pre_feedforward_layernorm(hidden))
        return hidden + self.post_feedforward_layernorm(fed)


class GemmaModel(nn.Module):
    """Embedding, decoder layers and final norm (HF's ``model.`` prefix); with pipeline
    stages, as :class:`~vlite.models.llama.LlamaModel` splits them."""

    def __init__(
        self, config: Any, layers: list[nn.Module], pp_group: PipelineParallelGroup
    ) -> None:
        super().__init__()
        tied = bool(getattr(config, "tie_word_embeddings", True))
        if pp_group.is_first or (pp_group.is_last and tied):
            self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(layers)
        #: Indices of the layers this stage runs.
        self.layer_indices = range(*pp_group.layer_range(config.num_hidden_layers))
        if pp_group.is_last:
            self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)


class GemmaForCausalLM(LlamaForCausalLM):
    """Implements :class:`vlite.core.model.CausalLM` for Gemma 2 and Gemma 3 (text).

    Reuses :class:`~vlite.models.llama.LlamaForCausalLM`'s weight loading (fused q/k/v and
    gate/up) and logits; builds its own layers (module docstring).
    """

    supports_tensor_parallel = True
    supports_pipeline_parallel = True
    #: A stage hands the next one the residual stream only (the norms sandwich the blocks).
    num_intermediate_tensors = 1
    supports_block_quantized_weights = True
    #: Gemma's four norms per layer, by their GGUF names.
    gguf_layer_modules = {**LLAMA_LAYER_MODULES, **GEMMA_MODULES}

    def __init__(
        self,
        hf_config: Any,
        attn_backend_cls: type[AttentionBackend],
        block_size: int,
        tp_group: TensorParallelGroup = SINGLE_RANK,
        pp_group: PipelineParallelGroup = SINGLE_STAGE,
    ) -> None:
        nn.Module.__init__(self)  # not Llama's __init__: Gemma builds its own layers
        _check_supported(hf_config)
        held = self.set_up_stage(
            hf_config,
            attn_backend_cls,
            block_size,
            tp_group,
            pp_group,
            scale=hf_config.query_pre_attn_scalar**-0.5,
            tied_by_default=True,
        )
        self.rotary_emb = RotaryEmbedding.from_config(hf_config, self.head_dim)
        self.local_rotary_emb = self._local_rotary(hf_config)
        self.model = GemmaModel(hf_config, self._layers(hf_config, held), pp_group)
        self.add_lm_head()
        self.final_logit_soft_cap: float | None = (
            getattr(hf_config, "final_logit_softcapping", None) or None
        )
        self.native_ops: Any = None
        self.long_rope_threshold: int | None = None

    def _local_rotary(self, config: Any) -> RotaryEmbedding:
        """Gemma 3's local layers rotate with their own base; Gemma 2 has one table."""
        if getattr(config, "model_type", "") == "gemma2":
            return self.rotary_emb
        return RotaryEmbedding.from_config(config, self.head_dim, "sliding_attention")

    def _layers(self, config: Any, held: range) -> list[nn.Module]:
        """Every layer index's module: a decoder layer for those this stage holds."""
        qk_norm = getattr(config, "model_type", "") != "gemma2"
        cap = getattr(config, "attn_logit_softcapping", None) or None
        layers: list[nn.Module] = []
        for index, window in enumerate(layer_sliding_windows(config)):
            if index not in held:
                layers.append(PipelineMissingLayer())
                continue
            local = window is not None
            rotary = self.local_rotary_emb if local else self.rotary_emb
            self_attn = GemmaAttention(config, self.attention, rotary, qk_norm, self.tp_group)
            self_attn.sliding_window = window
            self_attn.logits_soft_cap = cap
            layers.append(GemmaDecoderLayer(config, self_attn, local, self.tp_group))
        return layers

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        attn_metadata: AttentionMetadata,
        intermediate_tensors: list[torch.Tensor] | None = None,
    ) -> torch.Tensor | list[torch.Tensor]:
        """``input_ids``/``positions`` ``[T]`` -> final-normed hidden states ``[T, hidden]``
        (a pipeline stage after the first starts from ``intermediate_tensors``, one before
        the last returns them)."""
        if len(kv_caches) != self.num_layers:
            raise ValueError(f"expected {self.num_layers} KV caches, got {len(kv_caches)}")
        if intermediate_tensors is None:
            hidden = self.model.embed_tokens(input_ids)
            hidden = hidden * torch.tensor(self.config.hidden_size**0.5, dtype=hidden.dtype)
        else:
            (hidden,) = intermediate_tensors
        global_rotation = StepRotation(self.rotary_emb, positions, hidden.dtype)
        local_rotation = global_rotation
        if self.local_rotary_emb is not self.rotary_emb:
            local_rotation = StepRotation(self.local_rotary_emb, positions, hidden.dtype)
        layers = [self.model.layers[index] for index in self.model.layer_indices]
        for layer, kv_cache in zip(layers, kv_caches, strict=True):
            rotation = local_rotation if layer.local else global_rotation
            hidden = layer(rotation, hidden, kv_cache, attn_metadata)
        if not self.pp_group.is_last:
            return [hidden]
        return self.model.norm(hidden)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[n, hidden_size]`` -> ``[n, vocab_size]`` float32 logits, soft-capped when the
        config says so."""
        logits = super().compute_logits(hidden_states)
        cap = self.final_logit_soft_cap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def use_fused_ops(self, ops: Any) -> None:
        """Gemma keeps PyTorch's ops (its norms and GeGLU have no fused kernels)."""


def _check_supported(config: Any) -> None:
    act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)
    if act not in _ACTIVATIONS:
        raise ValueError(
            f"{config.model_type}: hidden_activation={act!r} is not supported (supported: "
            f"{', '.join(_ACTIVATIONS)})"
        )


@hookimpl
def register_models(register: Register) -> None:
    for architecture in ARCHITECTURES:
        register(architecture, GemmaForCausalLM)
