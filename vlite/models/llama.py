"""The Llama-family decoder: Llama, Mistral, Qwen2 and Qwen3 in one implementation.

Differences between the four, all read from the Hugging Face config:

- Qwen2 has biases on the q/k/v projections (never on ``o_proj``);
- Qwen3 applies a per-head RMSNorm (``q_norm``/``k_norm``) to queries and keys before RoPE,
  and its ``head_dim`` may differ from ``hidden_size // num_attention_heads``;
- Llama/Qwen3 honour ``attention_bias`` (q/k/v/o) and Llama ``mlp_bias``;
- embeddings are tied to the LM head when ``tie_word_embeddings`` is set.

For speed q/k/v are one fused ``qkv_proj`` and gate/up one fused ``gate_up_proj``;
:meth:`LlamaForCausalLM.load_weights` copies each Hugging Face tensor into its slice.

Tensor parallelism (a ``tp_group`` of world size > 1, see
:mod:`vlite.models.parallel_layers`): attention heads, KV heads and the MLP's
intermediate features are split over the ranks, ``o_proj``/``down_proj`` all-reduce, the
LM head splits the vocabulary and all-gathers the logits. The embedding is replicated: a
lookup of the step's tokens then needs no collective (a vocabulary-parallel embedding
would cost one all-reduce of ``[num_tokens, hidden]`` per step to save its memory).

Parameters are created in ``torch.get_default_dtype()`` on the default device:
:func:`vlite.models.loader.build_model` sets both while constructing. Calling ``.to(dtype)``
afterwards also works (the RoPE cos/sin cache then follows the dtype).

Sliding-window attention: each layer's window comes from the config
(:func:`vlite.models.spec.layer_sliding_windows`: Mistral's ``sliding_window``, Qwen2's
``use_sliding_window`` from ``max_window_layers`` on, per-layer ``layer_types``) and is
passed to the attention backend as ``sliding_window`` for that layer's calls.

Hooks a subclass overrides, class methods of the config read once at construction:
:meth:`~LlamaForCausalLM.attention_scale`, :meth:`~LlamaForCausalLM.embedding_multiplier`,
:meth:`~LlamaForCausalLM.residual_multiplier` and :meth:`~LlamaForCausalLM.logits_scaling`
(Granite's four multipliers; docs/models.md). The defaults are Llama's and multiply
nothing. A multiplier other than 1.0 is a PyTorch multiplication, so with quantized weights
on the CPU such a model's decode steps run eagerly instead of being replayed
(:mod:`vlite.worker.cpu_graphs` says why).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterable, Mapping
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from vlite.core.attention import AttentionBackend, AttentionMetadata
from vlite.core.errors import ConfigError
from vlite.core.hookspecs import Register, hookimpl
from vlite.core.weight_format import QuantizedWeight
from vlite.distributed.parallel_state import SINGLE_RANK, TensorParallelGroup
from vlite.distributed.pipeline import SINGLE_STAGE, PipelineParallelGroup
from vlite.kernels.native import NativeKernelsUnavailable, fused_ops
from vlite.models.gguf_names import LLAMA_LAYER_MODULES, ExpertNames, hf_name_for_gguf_tensor
from vlite.models.parallel_layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    ShardedModule,
    VocabEmbedding,
    VocabParallelLMHead,
)
from vlite.models.rope import RotaryEmbedding, StepRotation
from vlite.models.spec import head_dim_of, layer_sliding_windows

ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)

# Hugging Face projection name -> (fused parameter name, shard name).
_STACKED = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", "gate"),
    "up_proj": ("gate_up_proj", "up"),
}


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dim, computed in float32 and cast back (as HF).

    Given a ``residual``, it first adds ``x`` to it (the decoder's skip connection) and
    returns the norm of the sum and the sum, as vLLM's fused add-norm does. With
    :attr:`native` set (C kernels on the quantized CPU path, Triton ones on CUDA), inputs
    it handles take one kernel, which updates ``residual`` in place.
    """

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        #: :class:`~vlite.kernels.native.FusedOps`, or ``None`` for PyTorch ops.
        self.native: Any = None

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``[..., size]`` -> normed ``[..., size]`` in ``x.dtype`` (and the new residual)."""
        if self._runs_fused(x):
            out = self.native.add_rmsnorm(x.contiguous(), residual, self.weight, self.eps)
            return out if residual is None else (out, residual)
        if residual is not None:
            residual = x + residual
            return self._norm(residual), residual
        return self._norm(x)

    def _runs_fused(self, x: torch.Tensor) -> bool:
        native = self.native
        return (
            native is not None
            and native.handles(x.dtype, x.device)
            and self.weight.dtype == x.dtype
            and (x.dim() == 2 or native.norms_any_rank)
        )

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def _is_qwen2(config: Any) -> bool:
    return getattr(config, "model_type", "") in ("qwen2", "qwen2_moe")


def _check_supported(config: Any) -> None:
    act = getattr(config, "hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"{config.model_type}: hidden_act={act!r} is not supported (only silu)")


class LlamaAttention(nn.Module):
    """Self-attention: fused qkv projection, optional q/k norm, RoPE, paged attention."""

    def __init__(
        self,
        config: Any,
        attention: AttentionBackend,
        rotary: RotaryEmbedding,
        tp_group: TensorParallelGroup = SINGLE_RANK,
    ):
        super().__init__()
        # This rank's heads (all of them at world size 1).
        self.num_heads = config.num_attention_heads // tp_group.world_size
        self.num_kv_heads = config.num_key_value_heads // tp_group.world_size
        self.head_dim = head_dim_of(config)
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        attention_bias = bool(getattr(config, "attention_bias", False))
        qkv_bias = True if _is_qwen2(config) else attention_bias
        o_bias = False if _is_qwen2(config) else attention_bias
        hidden = config.hidden_size
        full_q = config.num_attention_heads * self.head_dim
        full_kv = config.num_key_value_heads * self.head_dim
        self.qkv_proj = ColumnParallelLinear(
            hidden, {"q": full_q, "k": full_kv, "v": full_kv}, qkv_bias, tp_group
        )
        self.o_proj = RowParallelLinear(full_q, hidden, o_bias, tp_group)
        self.has_qk_norm = getattr(config, "model_type", "") in ("qwen3", "qwen3_moe")
        if self.has_qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        # Shared by every layer: one backend object and one RoPE table (a module registered
        # in several places is moved/cast once by .to()).
        self.attention = attention
        self.rotary_emb = rotary
        #: ``False``: positions are not rotated into this layer's queries and keys (a NoPE
        #: layer, as SmolLM3's every fourth).
        self.use_rope = True
        #: This layer's attention window in tokens (``None``: the whole context); set by
        #: the model from the config.
        self.sliding_window: int | None = None
        #: The cap of this layer's attention scores (Gemma 2), ``None``: uncapped.
        self.logits_soft_cap: float | None = None

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """The backend's paged attention for this layer (windowed, soft-capped when it is):
        ``[T, heads, head_dim]`` queries -> ``[T, heads, head_dim]``."""
        options: dict[str, Any] = {}
        if self.sliding_window is not None:
            options["sliding_window"] = self.sliding_window
        if self.logits_soft_cap is not None:
            options["logits_soft_cap"] = self.logits_soft_cap
        return self.attention.forward(q, k, v, kv_cache, metadata, **options)

    def forward(
        self,
        rotation: StepRotation,
        hidden: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """``hidden`` ``[T, hidden_size]`` -> ``[T, hidden_size]``, rotating by the step's
        positions."""
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        q, k, v = self.split_heads(qkv)
        if self.has_qk_norm and self._norms_heads_in_place(rotation):
            norm = self.q_norm
            self.norm_qk_heads_(qkv, norm.native, norm.weight, self.k_norm.weight, norm.eps)
            rotation.rotate_rows_(qkv, self.num_heads + self.num_kv_heads)
        elif self.has_qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
            if self.use_rope:
                q, k = rotation.rotate(q), rotation.rotate(k)
        elif self.use_rope:
            # Queries and keys are adjacent in qkv: one rotation for both.
            num_qk_heads = self.num_heads + self.num_kv_heads
            if not rotation.rotate_rows_(qkv, num_qk_heads):
                qk = qkv[:, : self.q_size + self.kv_size]
                qk = rotation.rotate(qk.view(num_tokens, num_qk_heads, self.head_dim))
                q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        out = self.attend(q, k, v, kv_cache, metadata)  # [T, heads, head_dim]
        return self.o_proj(out.reshape(num_tokens, self.q_size))

    def split_heads(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Views of ``qkv`` ``[T, q_size + 2 kv_size]`` as ``q`` ``[T, heads, head_dim]``,
        ``k`` and ``v`` ``[T, kv_heads, head_dim]``."""
        num_tokens, q_end = qkv.shape[0], self.q_size
        k_end = q_end + self.kv_size
        q = qkv[:, :q_end].view(num_tokens, self.num_heads, self.head_dim)
        k = qkv[:, q_end:k_end].view(num_tokens, self.num_kv_heads, self.head_dim)
        v = qkv[:, k_end:].view(num_tokens, self.num_kv_heads, self.head_dim)
        return q, k, v

    def norm_qk_heads_(
        self,
        qkv: torch.Tensor,
        ops: Any,
        q_weight: torch.Tensor,
        k_weight: torch.Tensor,
        eps: float,
    ) -> None:
        """RMSNorm, in place, of every query head of ``qkv`` ``[T, q_size + 2 kv_size]``
        (times ``q_weight`` ``[head_dim]``) and every key head (times ``k_weight``): one
        ``ops.rmsnorm_heads_`` call each."""
        ops.rmsnorm_heads_(qkv, self.num_heads, self.head_dim, q_weight, eps)
        keys = qkv[:, self.q_size :]
        ops.rmsnorm_heads_(keys, self.num_kv_heads, self.head_dim, k_weight, eps)

    def _norms_heads_in_place(self, rotation: StepRotation) -> bool:
        """Whether the q/k norms and RoPE run in place on the qkv product, one C call each
        (fused ops with ``rmsnorm_heads_`` on float32 weights, rotating natively)."""
        ops = self.q_norm.native
        return (
            self.use_rope
            and rotation.native is not None
            and hasattr(ops, "rmsnorm_heads_")
            and self.q_norm.weight.dtype == self.k_norm.weight.dtype == torch.float32
        )


class LlamaMLP(nn.Module):
    """SwiGLU feed-forward with a fused gate/up projection (``intermediate_size`` features
    unless given, e.g. for a mixture's shared expert)."""

    def __init__(
        self,
        config: Any,
        tp_group: TensorParallelGroup = SINGLE_RANK,
        intermediate_size: int | None = None,
    ):
        super().__init__()
        bias = bool(getattr(config, "mlp_bias", False))
        size = intermediate_size or config.intermediate_size
        self.gate_up_proj = ColumnParallelLinear(
            config.hidden_size, {"gate": size, "up": size}, bias, tp_group
        )
        self.down_proj = RowParallelLinear(size, config.hidden_size, bias, tp_group)
        #: :class:`~vlite.kernels.native.FusedOps` for ``silu(gate) * up``, or ``None``.
        self.native: Any = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, hidden_size]`` -> ``[T, hidden_size]`` (this rank's share of the features)."""
        gate_up = self.gate_up_proj(x)
        if self.native is not None and self.native.handles(gate_up.dtype, gate_up.device):
            return self.down_proj(self.native.silu_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block: ``x + attn(norm(x))`` then ``x + mlp(norm(x))``, in HF's order.

    ``mlp`` is the feed-forward module (default: :class:`LlamaMLP`; a mixture of experts
    in Mixtral), any module mapping ``[T, hidden_size]`` to ``[T, hidden_size]``.
    """

    def __init__(
        self,
        config: Any,
        attention: AttentionBackend,
        rotary: RotaryEmbedding,
        tp_group: TensorParallelGroup = SINGLE_RANK,
        mlp: nn.Module | None = None,
        self_attn: nn.Module | None = None,
    ):
        super().__init__()
        if self_attn is None:
            self_attn = LlamaAttention(config, attention, rotary, tp_group)
        self.self_attn = self_attn
        self.mlp = mlp if mlp is not None else LlamaMLP(config, tp_group)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        #: Scales each sublayer's output before it joins the residual stream (Granite's
        #: ``residual_multiplier``); set by the model from
        #: :meth:`LlamaForCausalLM.residual_multiplier`. At 1.0 nothing is multiplied.
        self.residual_scale: float = 1.0

    def forward(
        self,
        rotation: StepRotation,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The block on ``hidden`` ``[T, hidden_size]``: returns ``(mlp output, residual)``.

        The skip connections are carried as ``residual`` (``None`` for the first layer) and
        added inside the norms, so ``residual + mlp output`` is HF's layer output. With a
        :attr:`residual_scale` other than 1.0 both sublayer outputs are multiplied by it
        before they are added (``residual + out * scale``, as Granite), which every path of
        the norms' add (PyTorch, fused C or Triton kernels) then adds unchanged.
        """
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self._scaled(self.self_attn(rotation, hidden, kv_cache, metadata))
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self._scaled(self.mlp(hidden)), residual

    def _scaled(self, out: torch.Tensor) -> torch.Tensor:
        """A sublayer's output ``[T, hidden_size]`` times :attr:`residual_scale` (itself
        when that is 1.0)."""
        scale = self.residual_scale
        return out if scale == 1.0 else out * scale


class PipelineMissingLayer(nn.Module):
    """Stands in for a layer another pipeline stage holds (no parameters, never run)."""


class LlamaModel(nn.Module):
    """Embedding, decoder layers and final norm (HF's ``model.`` prefix).

    With pipeline parallelism only ``layer_range``'s layers are built (the others are
    :class:`PipelineMissingLayer`, so names keep their indices), the embedding only where it
    is used (the first stage, and the last when the LM head is tied to it) and the final
    norm on the last stage.
    """

    def __init__(
        self,
        config: Any,
        attention: AttentionBackend,
        rotary: RotaryEmbedding,
        tp_group: TensorParallelGroup = SINGLE_RANK,
        make_mlp: Any = None,
        make_attention: Any = None,
        pp_group: PipelineParallelGroup = SINGLE_STAGE,
    ):
        super().__init__()
        start, end = pp_group.layer_range(config.num_hidden_layers)
        tied = bool(getattr(config, "tie_word_embeddings", False))
        if pp_group.is_first or (pp_group.is_last and tied):
            self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        make_mlp = make_mlp or (lambda config, tp_group, index: LlamaMLP(config, tp_group))
        make_attention = make_attention or LlamaAttention
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(
                config,
                attention,
                rotary,
                tp_group,
                make_mlp(config, tp_group, index),
                make_attention(config, attention, rotary, tp_group),
            )
            if start <= index < end
            else PipelineMissingLayer()
            for index in range(config.num_hidden_layers)
        )
        #: Indices of the layers this stage runs.
        self.layer_indices = range(start, end)
        if pp_group.is_last:
            self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """Implements :class:`vlite.core.model.CausalLM` for the four Llama-family architectures.

    Args:
        hf_config: a ``transformers`` config of model type llama, mistral, qwen2 or qwen3.
        attn_backend_cls: the attention backend class, instantiated once as
            :attr:`attention` and shared by every layer.
        block_size: tokens per KV-cache block.
        tp_group: the ranks the model is split over (see
            :func:`check_tensor_parallel_size` for the sizes a config allows).
    """

    #: Accepts a ``tp_group`` of any world size :func:`check_tensor_parallel_size` allows.
    supports_tensor_parallel = True
    #: Accepts a ``pp_group``: builds only its stage's layers (see :class:`LlamaModel`).
    supports_pipeline_parallel = True
    #: Tensors a stage hands to the next: the hidden states and the residual stream.
    num_intermediate_tensors = 2
    #: Each layer's self-attention module, built as ``cls(config, attention, rotary,
    #: tp_group)`` (a subclass may name another, e.g. OLMoE's).
    attention_class: type[nn.Module] = LlamaAttention
    #: :meth:`load_weights` takes quantized weights (a weight format's
    #: :class:`~vlite.core.weight_format.QuantizedWeight`) and keeps them quantized.
    supports_block_quantized_weights = True
    #: GGUF layer module -> Hugging Face module within a layer (``attn_q`` ->
    #: ``self_attn.q_proj``), read by :meth:`hf_name_for_gguf_tensor`.
    gguf_layer_modules: ClassVar[Mapping[str, str]] = LLAMA_LAYER_MODULES
    #: How the checkpoint names the experts' matrices (``None``: the model has no experts).
    gguf_expert_names: ClassVar[ExpertNames | None] = None

    def __init__(
        self,
        hf_config: Any,
        attn_backend_cls: type[AttentionBackend],
        block_size: int,
        tp_group: TensorParallelGroup = SINGLE_RANK,
        pp_group: PipelineParallelGroup = SINGLE_STAGE,
    ) -> None:
        super().__init__()
        _check_supported(hf_config)
        self.set_up_stage(hf_config, attn_backend_cls, block_size, tp_group, pp_group)
        self.rotary_emb = RotaryEmbedding.from_config(hf_config, self.head_dim)
        #: LongRoPE: sequences of more known tokens use the long factors (read per token
        #: from ``AttentionMetadata.context_lens_at_cache_start``); ``None`` without it.
        self.long_rope_threshold: int | None = self.rotary_emb.long_rope_threshold
        self.model = LlamaModel(
            hf_config,
            self.attention,
            self.rotary_emb,
            tp_group,
            self.make_mlp,
            self.attention_class,
            pp_group,
        )
        for layer, window in zip(self.model.layers, layer_sliding_windows(hf_config)):
            if not isinstance(layer, PipelineMissingLayer):
                layer.self_attn.sliding_window = window
                layer.residual_scale = self.residual_scale
        self.add_lm_head()
        #: Fused C kernels for norms and RoPE (set when weights stay quantized on the CPU).
        self.native_ops: Any = None

    @classmethod
    def hf_name_for_gguf_tensor(cls, gguf_name: str, expert: int | None = None) -> str:
        """The Hugging Face name of GGUF tensor ``gguf_name`` (with ``expert``: that
        expert's matrix of a stacked experts tensor such as ``blk.3.ffn_up_exps.weight``),
        from :attr:`gguf_layer_modules` and :attr:`gguf_expert_names`; the GGUF loader asks
        it for every tensor of a file. Raises ``ValueError`` naming a tensor the model does
        not have."""
        return hf_name_for_gguf_tensor(
            gguf_name,
            expert,
            layer_modules=cls.gguf_layer_modules,
            experts=cls.gguf_expert_names,
            owner=cls.__name__,
        )

    def set_up_stage(
        self,
        hf_config: Any,
        attn_backend_cls: type[AttentionBackend],
        block_size: int,
        tp_group: TensorParallelGroup,
        pp_group: PipelineParallelGroup,
        scale: float | None = None,
        tied_by_default: bool = False,
    ) -> range:
        """What every model of this family sets first: the config, the parallel groups, the
        stage's layer count, the head size, whether embeddings are tied (the config's
        ``tie_word_embeddings``, else ``tied_by_default``), the attention backend (scores
        scaled by ``scale``, default :meth:`attention_scale`) and the multipliers of the
        hooks :meth:`embedding_multiplier`, :meth:`residual_multiplier` and
        :meth:`logits_scaling`. Returns the indices of the layers this stage holds.

        Raises:
            ValueError: the config does not split over ``tp_group``.
        """
        self.check_tensor_parallel_size(hf_config, tp_group.world_size)
        self.config = hf_config
        self.tp_group = tp_group
        self.pp_group = pp_group
        start, end = pp_group.layer_range(hf_config.num_hidden_layers)
        #: Layers this pipeline stage runs (and KV caches it holds).
        self.num_layers: int = end - start
        self.head_dim = head_dim_of(hf_config)
        tied = getattr(hf_config, "tie_word_embeddings", tied_by_default)
        self.tie_word_embeddings = bool(tied)
        self.attention: AttentionBackend = attn_backend_cls(
            hf_config.num_attention_heads // tp_group.world_size,
            hf_config.num_key_value_heads // tp_group.world_size,
            self.head_dim,
            scale=self.attention_scale(hf_config) if scale is None else scale,
            block_size=block_size,
        )
        #: Multiplies the token embeddings (1.0: untouched).
        self.embedding_scale = float(self.embedding_multiplier(hf_config))
        #: Multiplies each sublayer's output before the residual add (1.0: untouched).
        self.residual_scale = float(self.residual_multiplier(hf_config))
        #: Divides the logits (1.0: untouched).
        self.logits_divisor = float(self.logits_scaling(hf_config))
        return range(start, end)

    # ---- hooks a subclass overrides (defaults: Llama's; Granite's in docs/models.md) -----

    @classmethod
    def attention_scale(cls, hf_config: Any) -> float:
        """The factor attention scores ``q . k`` are multiplied by before the softmax.

        Default ``head_dim ** -0.5``; Granite's is ``config.attention_multiplier``.
        """
        return head_dim_of(hf_config) ** -0.5

    @classmethod
    def embedding_multiplier(cls, hf_config: Any) -> float:
        """The factor the token embeddings ``[T, hidden]`` are multiplied by (in their
        dtype) before the first layer. Default 1.0 (no multiplication); Granite's is
        ``config.embedding_multiplier``."""
        return 1.0

    @classmethod
    def residual_multiplier(cls, hf_config: Any) -> float:
        """The factor each sublayer's output (attention's, then the MLP's) is multiplied
        by before it is added to the residual stream: ``residual + out * m``. Default 1.0
        (no multiplication); Granite's is ``config.residual_multiplier``."""
        return 1.0

    @classmethod
    def logits_scaling(cls, hf_config: Any) -> float:
        """The divisor of the float32 logits ``[n, vocab]``. Default 1.0 (no division);
        Granite's is ``config.logits_scaling``."""
        return 1.0

    def add_lm_head(self) -> None:
        """The vocabulary projection, on the last pipeline stage (weightless when tied)."""
        if self.pp_group.is_last:
            self.lm_head = VocabParallelLMHead(
                self.config.vocab_size,
                self.config.hidden_size,
                has_weight=not self.tie_word_embeddings,
                tp_group=self.tp_group,
            )

    @classmethod
    def check_tensor_parallel_size(cls, hf_config: Any, tensor_parallel_size: int) -> None:
        """Raise ``ValueError`` unless ``hf_config`` splits over ``tensor_parallel_size``."""
        check_tensor_parallel_size(hf_config, tensor_parallel_size)

    @staticmethod
    def make_mlp(config: Any, tp_group: TensorParallelGroup, layer_index: int) -> nn.Module:
        """Layer ``layer_index``'s feed-forward module (a subclass may return another, e.g.
        a mixture of experts)."""
        return LlamaMLP(config, tp_group)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        attn_metadata: AttentionMetadata,
        intermediate_tensors: list[torch.Tensor] | None = None,
    ) -> torch.Tensor | list[torch.Tensor]:
        """``input_ids``/``positions`` ``[T]`` -> final-normed hidden states ``[T, hidden]``.

        In a pipeline, a stage after the first starts from the previous stage's
        ``intermediate_tensors`` (hidden states and residual, ``[T, hidden]`` each) instead
        of the embedding, and a stage before the last returns them for the next.
        """
        if len(kv_caches) != self.num_layers:
            raise ValueError(f"expected {self.num_layers} KV caches, got {len(kv_caches)}")
        if intermediate_tensors is None:
            hidden, residual = self.embed(input_ids), None
        else:
            hidden, residual = intermediate_tensors
        rotation = StepRotation(
            self.rotary_emb,
            positions,
            hidden.dtype,
            self.native_ops,
            context_lens=attn_metadata.context_lens_at_cache_start,
        )
        layers = [self.model.layers[index] for index in self.model.layer_indices]
        for layer, kv_cache in zip(layers, kv_caches, strict=True):
            hidden, residual = layer(rotation, hidden, residual, kv_cache, attn_metadata)
        if not self.pp_group.is_last:
            return [hidden, residual]
        return self.model.norm(hidden, residual)[0]

    @property
    def replay_unavailable_reason(self) -> str | None:
        """Why a decode step of this model cannot be captured and replayed (the worker asks;
        ``None``: it can)."""
        if self.long_rope_threshold is not None:
            return "a LongRoPE model rotates by the context's length, known only per step"
        return None

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[T]`` token ids -> ``[T, hidden]`` embeddings, times :attr:`embedding_scale`
        when that is not 1.0."""
        hidden = self.model.embed_tokens(input_ids)
        scale = self.embedding_scale
        return hidden if scale == 1.0 else hidden * scale

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[n, hidden_size]`` -> ``[n, vocab_size]`` float32 logits (full on every rank),
        divided by :attr:`logits_divisor` when that is not 1.0."""
        tied = self.model.embed_tokens.table if self.tie_word_embeddings else None
        logits = self.lm_head(hidden_states, tied)
        divisor = self.logits_divisor
        return logits if divisor == 1.0 else logits / divisor

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors into the (partly fused, maybe sharded) parameters.

        Every tensor is full-sized; a sharded layer keeps this rank's slice. A
        :class:`~vlite.core.weight_format.QuantizedWeight` stays quantized in the linear
        layers, the embedding and the experts (dequantized anywhere else). Rotary buffers
        (``rotary_emb.inv_freq`` and the like) and, with tied embeddings,
        ``lm_head.weight`` are skipped. Raises ``ValueError`` for an unknown name, a shape
        mismatch, or any parameter (or fused shard) left unloaded.
        """
        params = dict(self.named_parameters())
        pending = self._expected_shards()
        for hf_name, tensor in weights:
            if "rotary_emb." in hf_name:  # inv_freq / cos / sin caches: recomputed here
                continue
            if self._held_by_another_stage(hf_name):
                continue
            if self.load_own_weight(hf_name, tensor):
                continue
            if hf_name == "lm_head.weight" and self.tie_word_embeddings:
                continue
            name, shard = _map_name(hf_name)
            if name not in params:
                raise ConfigError(f"unexpected weight {hf_name!r} for {type(self).__name__}")
            module_name, leaf = name.rsplit(".", 1)
            module = self.get_submodule(module_name)
            if isinstance(module, ShardedModule):
                expected = module.full_shape(leaf, shard)
            else:
                expected = tuple(params[name].shape)
            if tuple(tensor.shape) != expected:
                raise ConfigError(
                    f"weight {hf_name!r} has shape {tuple(tensor.shape)}, expected {expected}"
                )
            if isinstance(module, ShardedModule):
                module.load_full(leaf, tensor, shard)
            else:
                if isinstance(tensor, QuantizedWeight):
                    tensor = tensor.dequantize()
                params[name].data.copy_(tensor)
            pending.discard((name, shard))
        pending.update((name, None) for name in self.own_missing_weights())
        if pending:
            missing = sorted(f"{n} ({s})" if s else n for n, s in pending)
            raise ConfigError(f"missing weights: {', '.join(missing[:10])} ({len(missing)} total)")
        if any(getattr(m, "quantized", None) is not None for m in self.modules()):
            self.use_native_ops()

    def local_layers(self) -> list[tuple[int, nn.Module]]:
        """``(index, layer)`` of every layer this pipeline stage holds (all without one)."""
        return [(index, self.model.layers[index]) for index in self.model.layer_indices]

    def _held_by_another_stage(self, hf_name: str) -> bool:
        """Whether a checkpoint tensor belongs to a part of the model another pipeline stage
        holds (always ``False`` without pipeline parallelism)."""
        if self.pp_group.num_stages == 1:
            return False
        if hf_name.startswith("model.layers."):
            index = int(hf_name.split(".", 3)[2])
            return index not in self.model.layer_indices
        if hf_name.startswith("model.embed_tokens."):
            return not hasattr(self.model, "embed_tokens")
        if hf_name.startswith(("model.norm.", "lm_head.")):
            return not self.pp_group.is_last
        return False

    def load_own_weight(self, hf_name: str, tensor: torch.Tensor) -> bool:
        """A subclass's hook for weights it loads itself (experts); ``True``: taken."""
        return False

    def own_missing_weights(self) -> list[str]:
        """What a subclass's :meth:`load_own_weight` still expects."""
        return []

    def use_native_ops(self) -> None:
        """Run the norms, RoPE and SwiGLU's activation as fused C kernels on float32 CPU
        inputs.

        Done by :meth:`load_weights` when weights stay quantized (that path's oracle is its
        agreement with the float32 path; the float path keeps PyTorch's ops, bit for bit
        HF's). Where the kernels cannot be built it says so on stderr and keeps PyTorch's.
        """
        try:
            ops = fused_ops()
        except NativeKernelsUnavailable as error:
            print(
                f"fused ops: off ({error}); norms, RoPE and SwiGLU run in PyTorch",
                file=sys.stderr,
                flush=True,
            )
            return
        self.use_fused_ops(ops)

    def use_fused_ops(self, ops: Any) -> None:
        """Run the norms, RoPE and SwiGLU's activation through ``ops`` wherever it handles
        the tensors' dtype and device (``ops.handles``), PyTorch's ops elsewhere.

        ``ops`` has :class:`vlite.kernels.native.FusedOps`' interface: those C kernels (see
        :meth:`use_native_ops`), or the Triton ones the worker gives a model on CUDA
        (:mod:`vlite.models.layer_kernels`).
        """
        self.native_ops = ops
        for module in self.modules():
            if isinstance(module, (RMSNorm, LlamaMLP)):
                module.native = ops

    def _expected_shards(self) -> set[tuple[str, str | None]]:
        """Every ``(parameter name, shard)`` a complete checkpoint must provide."""
        expected: set[tuple[str, str | None]] = set()
        for name, _ in self.named_parameters():
            module = self.get_submodule(name.rsplit(".", 1)[0])
            if getattr(module, "loads_own_weights", False):
                continue  # loaded through load_own_weight
            pieces = module.piece_names if isinstance(module, ShardedModule) else ()
            expected.update((name, piece) for piece in pieces or (None,))
        return expected


def check_tensor_parallel_size(
    hf_config: Any, tensor_parallel_size: int, split: dict[str, int] | None = None
) -> None:
    """Raise ``ValueError`` unless the model splits evenly over ``tensor_parallel_size`` ranks.

    Attention heads, KV heads and the MLP's intermediate features are split (``split``
    replaces the MLP's entry: a mixture of experts splits whole experts); KV heads are not
    replicated, so ``tensor_parallel_size`` may not exceed ``num_key_value_heads``. The
    message names the values that do not divide and the sizes the model allows.
    """
    if tensor_parallel_size == 1:
        return
    sizes = {
        "num_attention_heads": hf_config.num_attention_heads,
        "num_key_value_heads": hf_config.num_key_value_heads,
    }
    sizes.update(split if split is not None else {"intermediate_size": hf_config.intermediate_size})
    bad = [f"{name}={value}" for name, value in sizes.items() if value % tensor_parallel_size]
    if not bad:
        return
    common = math.gcd(*sizes.values())
    allowed = [size for size in range(1, common + 1) if common % size == 0]
    note = ""
    if tensor_parallel_size > hf_config.num_key_value_heads:
        note = (
            f"; vlite does not replicate KV heads, so tensor_parallel_size cannot exceed "
            f"num_key_value_heads={hf_config.num_key_value_heads}"
        )
    raise ConfigError(
        f"{getattr(hf_config, 'model_type', 'the model')}: tensor_parallel_size="
        f"{tensor_parallel_size} does not divide {', '.join(bad)}{note}; this model "
        f"supports tensor_parallel_size in {{{', '.join(map(str, allowed))}}}"
    )


def _map_name(hf_name: str) -> tuple[str, str | None]:
    """``model.layers.0.self_attn.k_proj.bias`` -> (``...self_attn.qkv_proj.bias``, ``"k"``)."""
    parts = hf_name.split(".")
    if len(parts) >= 2 and parts[-2] in _STACKED:
        fused, shard = _STACKED[parts[-2]]
        return ".".join([*parts[:-2], fused, parts[-1]]), shard
    return hf_name, None


@hookimpl
def register_models(register: Register) -> None:
    for architecture in ARCHITECTURES:
        register(architecture, LlamaForCausalLM)
