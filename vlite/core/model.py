"""The interface a model architecture implements (registered with ``register_models``)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Protocol

import torch

from vlite.core.attention import AttentionBackend, AttentionMetadata


class ModelDescription(Protocol):
    """What the engine core reads about the model before any worker runs.

    The layer above resolves the model and passes this in
    (:class:`vlite.models.spec.ModelSpec`), so the core imports no model code.
    """

    @property
    def architecture(self) -> str:
        """The architecture name (``config.json``'s first ``architectures`` entry), which
        names the model class registered with ``register_models``."""
        ...

    @property
    def hf_config(self) -> Any:
        """The Hugging Face config the model class is built from (its layer and head counts
        say how the model splits over pipeline stages and tensor-parallel ranks)."""
        ...

    @property
    def max_model_len(self) -> int:
        """The context length requests must fit in."""
        ...

    @property
    def head_dim(self) -> int:
        """Values per attention head (the attention backend's shape)."""
        ...

    @property
    def sliding_windows(self) -> tuple[int | None, ...]:
        """Each layer's attention window in tokens (a token sees the last ``window``
        positions, itself included), ``None`` for a layer that sees the whole context."""
        ...

    @property
    def attention_logit_soft_cap(self) -> float | None:
        """The cap of the model's attention scores (``cap * tanh(score / cap)``), if any."""
        ...

    @property
    def prefix_caching_conflict(self) -> str | None:
        """Why the model's cached KV blocks cannot be shared between requests (the engine
        then runs without prefix caching), or ``None``."""
        ...

    @property
    def recompute_past_length(self) -> int | None:
        """A model whose cached keys depend on whether their sequence knows more than this
        many tokens (LongRoPE rotates every token with other factors past its pre-training
        context) has each request's cache computed again once it outgrows it; ``None``:
        the keys never depend on the length (see ``SchedulerLimits.recompute_past_length``)."""
        ...

    def quantization_plan(
        self, setting: str, device: torch.device, formats: Mapping[str, Any] | None = None
    ) -> Any:
        """Which weights stay quantized for ``setting`` on ``device``, in which of the
        registered weight ``formats`` (name -> :class:`~vlite.core.weight_format.WeightFormat`
        instance, in order of preference; ``describe(dtype)`` gives the line ``vlite run``
        prints)."""
        ...

    @property
    def vocab_size(self) -> int:
        """The width of the model's logits (tokens it can produce)."""
        ...

    def load_tokenizer(self) -> Any:
        """The model's Hugging Face tokenizer (the core loads it only for structured
        outputs, whose grammars are compiled over its tokens)."""
        ...


class CausalLM(Protocol):
    """A decoder-only language model over a flattened, paged batch.

    Constructed as ``cls(hf_config, attn_backend_cls, block_size)`` where ``hf_config``
    is a ``transformers.PretrainedConfig`` and ``attn_backend_cls`` an
    :class:`~vlite.core.attention.AttentionBackend` subclass the model instantiates once
    with its own head shape; it is exposed as :attr:`attention`.

    Tensor parallelism is optional. A class that supports it sets
    ``supports_tensor_parallel = True``, accepts a ``tp_group=``
    (:class:`~vlite.distributed.parallel_state.TensorParallelGroup`) keyword, which is
    passed only when the world size is above 1, and may define a classmethod
    ``check_tensor_parallel_size(hf_config, tensor_parallel_size)`` that raises
    ``ValueError`` for a size the config cannot be split into (the engine's configuration
    phase, :mod:`vlite.core.verify`, calls it before the executor is built). Its
    :meth:`compute_logits` must return the full vocabulary on every rank, and
    :meth:`load_weights` receives full-sized tensors and keeps the rank's slice.
    """

    attention: AttentionBackend
    num_layers: int

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """Run the decoder.

        Args:
            input_ids: ``[num_tokens]`` int64, the step's new tokens, flattened.
            positions: ``[num_tokens]`` int64, each token's position in its sequence.
            kv_caches: one cache tensor per layer, shaped by ``attention.kv_cache_shape``.
            attn_metadata: where each sequence's context lives in the caches.

        Returns:
            ``[num_tokens, hidden_size]`` final hidden states (after the last norm).
        """
        ...

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[n, hidden_size]`` -> ``[n, vocab_size]`` float32 logits."""
        ...

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load Hugging Face-named tensors (e.g. ``model.layers.0.self_attn.q_proj.weight``)."""
        ...
