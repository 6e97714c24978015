"""Gemma 2 and Gemma 3 (text): the Llama decoder reshaped, as a model plugin.

What differs from :mod:`vlite.models.llama`, all read from the Hugging Face config:

- embeddings are scaled by ``sqrt(hidden_size)`` (in the hidden dtype, as transformers);
- every RMSNorm multiplies by ``1 + weight`` (weights stored centred on 0), in float32;
- each block is "sandwiched": ``x + post_attn_norm(attn(input_norm(x)))`` then
  ``x + post_ffw_norm(mlp(pre_ffw_norm(x)))``, four norms per layer (the skip connections
  are carried as a residual added inside the next norm, as Llama's are);
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
included, are per head or replicated); pipeline stages split the layers as for Llama.

With quantized weights on the CPU (:meth:`GemmaForCausalLM.use_fused_ops`) the norms, the
q/k norms with RoPE, GeGLU's activation and the embedding's scale are C calls of
:class:`vlite.kernels.native.FusedOps`, so a decode step is C calls only and the worker
replays it (:mod:`vlite.worker.cpu_graphs`); the float path keeps PyTorch's ops, bit for bit
transformers'. GGUF files (llama.cpp's ``gemma2``/``gemma3``) load
through :mod:`vlite.models.gguf`, which undoes the converter's ``+1`` on norm weights.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vlite.core.attention import AttentionBackend, AttentionMetadata
from vlite.core.errors import ConfigError
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


#: What :meth:`GemmaForCausalLM.use_fused_ops` needs of the ops beyond Llama's.
FUSED_OPS_NEEDED = ("gelu_tanh_mul", "rmsnorm_heads_", "scale_")


class GemmaRMSNorm(nn.Module):
    """RMSNorm scaled by ``1 + weight``, computed in float32 and cast back (as Gemma).

    Given a ``residual``, it first adds ``x`` to it and returns the norm of the sum and the
    sum, as :class:`~vlite.models.llama.RMSNorm` does; with fused ops (:meth:`use_fused`) a
    float32 CPU ``[T, size]`` input takes one C call, which updates ``residual`` in place.
    """

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size))
        self.eps = eps
        #: :class:`~vlite.kernels.native.FusedOps`, or ``None`` for PyTorch ops.
        self.native: Any = None
        #: ``1 + weight`` in float32 (the factor the fused kernel multiplies by).
        self.fused_weight: torch.Tensor | None = None

    def use_fused(self, ops: Any) -> None:
        """Norm through ``ops`` (taking ``1 + weight`` as its weight, so call it once the
        weights are loaded)."""
        self.native = ops
        self.fused_weight = (1.0 + self.weight.detach().float()).contiguous()

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """``[..., size]`` -> normed ``[..., size]`` in ``x.dtype`` (and the new residual)."""
        native = self.native
        if native is not None and native.handles(x.dtype, x.device) and x.dim() == 2:
            out = native.add_rmsnorm(x.contiguous(), residual, self.fused_weight, self.eps)
            return out if residual is None else (out, residual)
        if residual is not None:
            residual = x + residual
            return self._norm(residual), residual
        return self._norm(x)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).to(x.dtype)


class GemmaMLP(LlamaMLP):
    """GeGLU feed-forward: ``down(gelu_tanh(gate) * up)`` with a fused gate/up projection."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, hidden_size]`` -> ``[T, hidden_size]``."""
        gate_up = self.gate_up_proj(x)
        if self.native is not None and self.native.handles(gate_up.dtype, gate_up.device):
            return self.down_proj(self.native.gelu_tanh_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
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
        #: :class:`~vlite.kernels.native.FusedOps` for the q/k norms, or ``None``.
        self.native: Any = None
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
        qkv = self.qkv_proj(hidden)  # [T, q_size + 2 kv_size]
        q, k, v = self.split_heads(qkv)
        if self.native is not None and rotation.native is not None:
            # The q/k norms and RoPE in place on the qkv product, one C call each.
            if self.has_gemma_qk_norm:
                q_norm, k_norm = self.q_norm, self.k_norm
                self.norm_qk_heads_(
                    qkv, self.native, q_norm.fused_weight, k_norm.fused_weight, q_norm.eps
                )
            rotation.rotate_rows_(qkv, self.num_heads + self.num_kv_heads)
        else:
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
        residual: torch.Tensor | None,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The block on ``hidden`` ``[T, hidden_size]``: returns ``(post-normed feed-forward
        output, residual)``, whose sum is transformers' layer output (``residual`` is
        ``None`` for the first layer; the sums are taken inside the next norms)."""
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        attended = self.self_attn(rotation, hidden, kv_cache, metadata)
        hidden, residual = self.pre_feedforward_layernorm(
            self.post_attention_layernorm(attended), residual
        )
        return self.post_feedforward_layernorm(self.mlp(hidden)), residual


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
            hidden, residual = self._scaled_embedding(input_ids), None
        else:
            hidden, residual = intermediate_tensors
        ops = self.native_ops
        global_rotation = StepRotation(self.rotary_emb, positions, hidden.dtype, ops)
        local_rotation = global_rotation
        if self.local_rotary_emb is not self.rotary_emb:
            local_rotation = StepRotation(self.local_rotary_emb, positions, hidden.dtype, ops)
        layers = [self.model.layers[index] for index in self.model.layer_indices]
        for layer, kv_cache in zip(layers, kv_caches, strict=True):
            rotation = local_rotation if layer.local else global_rotation
            hidden, residual = layer(rotation, hidden, residual, kv_cache, attn_metadata)
        if not self.pp_group.is_last:
            return [hidden, residual]
        return self.model.norm(hidden, residual)[0]

    def _scaled_embedding(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[T]`` -> ``[T, hidden]`` embeddings times ``sqrt(hidden_size)`` (rounded to the
        hidden dtype first, as transformers does)."""
        hidden = self.model.embed_tokens(input_ids)
        normalizer = self.config.hidden_size**0.5
        if self.native_ops is not None and self.native_ops.handles(hidden.dtype, hidden.device):
            self.native_ops.scale_(hidden, normalizer)  # a fresh lookup: scaled in place
            return hidden
        return hidden * torch.tensor(normalizer, dtype=hidden.dtype)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[n, hidden_size]`` -> ``[n, vocab_size]`` float32 logits, soft-capped when the
        config says so."""
        logits = super().compute_logits(hidden_states)
        cap = self.final_logit_soft_cap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def use_fused_ops(self, ops: Any) -> None:
        """Run the norms (``1 + weight``), the q/k norms and RoPE, GeGLU's activation and the
        embedding's scale through ``ops`` where it handles the tensors; ops without Gemma's
        kernels (:data:`FUSED_OPS_NEEDED`, e.g. the Triton ones on CUDA) leave PyTorch's."""
        if not all(hasattr(ops, name) for name in FUSED_OPS_NEEDED):
            return
        self.native_ops = ops
        for module in self.modules():
            if isinstance(module, GemmaRMSNorm):
                module.use_fused(ops)
            elif isinstance(module, (GemmaMLP, GemmaAttention)):
                module.native = ops


def _check_supported(config: Any) -> None:
    act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)
    if act not in _ACTIVATIONS:
        raise ConfigError(
            f"{config.model_type}: hidden_activation={act!r} is not supported (supported: "
            f"{', '.join(_ACTIVATIONS)})"
        )


@hookimpl
def register_models(register: Register) -> None:
    for architecture in ARCHITECTURES:
        register(architecture, GemmaForCausalLM)
