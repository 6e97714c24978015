"""The attention-backend interface and the metadata every backend receives.

A step's batch is *flattened*: the new tokens of all scheduled sequences are laid end to
end (no padding), ``num_tokens`` in all. Sequence ``i`` owns query rows
``query_start_loc[i]:query_start_loc[i+1]``; those are the *last* ``query_len`` tokens of a
context of ``seq_lens[i]`` tokens, so a prefill whose prefix came from the prefix cache, a
prompt chunk and a one-token decode all look the same to a backend.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from vlite.core.errors import ConfigError


@dataclass
class AttentionMetadata:
    """Where each sequence's keys and values live in the paged cache.

    Attributes:
        slot_mapping: ``[num_tokens]`` int64. Cache slot of each new token,
            ``block_id * block_size + offset_in_block``; the backend writes the token's
            K/V there before attending.
        query_start_loc: ``[num_seqs + 1]`` int32. Cumulative query lengths; starts at 0.
        seq_lens: ``[num_seqs]`` int32. Context length of each sequence *including* its
            new tokens (cached prefix + new tokens).
        block_tables: ``[num_seqs, max_num_blocks]`` int32. Physical block ids of each
            sequence in logical order; entries past the sequence's last block are 0.
        max_query_len: Largest query length in the batch (host int).
        max_seq_len: Largest context length in the batch (host int).
        query_lens_cpu: Query length per sequence as host ints (for backends that loop).
        seq_lens_cpu: Context length per sequence as host ints.
        context_lens_at_cache_start: ``[num_tokens]`` int64, read by models whose keys
            depend on their sequence's length (LongRoPE, see :mod:`vlite.models.longrope`;
            backends ignore it): how many tokens each token's sequence knew when its cache
            was last computed from position 0. ``None`` where the builder of the metadata
            does not track it (a model then takes the step as one sequence).
    """

    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    max_query_len: int
    max_seq_len: int
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]
    context_lens_at_cache_start: torch.Tensor | None = None

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def is_all_decode(self) -> bool:
        """True when every sequence brings exactly one new token."""
        return self.max_query_len == 1


class AttentionBackend(ABC):
    """Computes causal attention over a paged KV cache, for one model's layer shape.

    One instance serves every layer of a model: the per-layer state is the cache tensor
    passed to :meth:`forward`. Registered with ``register_attention_backends``.

    Class attributes declare the backend's limits; the engine checks them at construction.
    """

    #: dtypes this backend computes in.
    supported_dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)
    # Capability flags, read by the conformance suite (vlite.testing.AttentionBackendConformance):
    #: Whether a sequence may bring several new tokens after cached context (prefix-cache
    #: hits, prompt chunks, recomputation); one-token decodes after context are always needed.
    supports_prefix_caching: bool = True
    #: Head dimensions the backend supports; ``None``: any.
    supported_head_dims: tuple[int, ...] | None = None
    #: Block sizes the backend supports; ``None``: any power of two.
    supported_block_sizes: tuple[int, ...] | None = None
    #: Whether :meth:`forward` takes ``sliding_window`` (a layer whose tokens see only the
    #: last ``sliding_window`` positions). The engine refuses a windowed model for a backend
    #: without it, and passes the keyword only for windowed layers, so a backend written
    #: before windows existed keeps working for every other model.
    supports_sliding_window: bool = False
    #: Whether :meth:`forward` takes ``logits_soft_cap`` (Gemma 2 caps attention scores at
    #: ``cap * tanh(score / cap)``); refused and passed like ``sliding_window``.
    supports_logits_soft_cap: bool = False
    #: Whether a decode step's :meth:`forward` may be captured into a CUDA graph and
    #: replayed (see :mod:`vlite.worker.cuda_graphs`): it reads the metadata's device
    #: tensors only, rewritten in place between replays, takes ``max_query_len`` and
    #: ``max_seq_len`` as bounds (the capture-time values hold for every replay), never reads
    #: the per-sequence host lists, never synchronises with the host, and keeps no tensor
    #: it allocates during a call for the next one. A backend without it runs eagerly.
    supports_cuda_graphs: bool = False
    #: KV-cache dtypes :meth:`forward` takes besides the model's own (``kv_cache_dtype``):
    #: it rounds the step's keys and values to the cache's dtype as it writes them and
    #: computes attention in the query's dtype. The conformance suite checks each claim
    #: against the reference fed the rounded keys and values.
    kv_cache_dtypes: tuple[torch.dtype, ...] = ()

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        block_size: int,
    ) -> None:
        if num_heads % num_kv_heads != 0:
            raise ConfigError(
                f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads}"
            )
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.block_size = block_size

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        """Shape of one layer's cache: ``[2, num_blocks, block_size, num_kv_heads, head_dim]``.

        Index 0 holds keys, index 1 values. A backend may override this with its own layout.
        """
        return (2, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        *,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ) -> torch.Tensor:
        """Write the new keys/values into ``kv_cache`` and attend.

        Every new key and value of the step is written before any query reads the cache:
        sequences may share blocks (a request verifying draft tokens comes as one one-token
        sequence per draft position over the same block table, each seeing the keys written
        for the positions before it).

        Args:
            query: ``[num_tokens, num_heads, head_dim]``.
            key: ``[num_tokens, num_kv_heads, head_dim]``.
            value: ``[num_tokens, num_kv_heads, head_dim]``.
            kv_cache: this layer's cache, shaped by :meth:`kv_cache_shape`.
            metadata: the step's :class:`AttentionMetadata`.
            sliding_window: this layer's window (passed only when set, and only to a
                backend with :attr:`supports_sliding_window`): the query at position ``p``
                sees keys ``p - sliding_window < k <= p``. Cache blocks wholly before the
                first query's window may already hold another request's tokens, so a
                backend must not let them into a result (masked scores of finite values
                are fine: the cache is zero-initialised and only ever holds keys/values).
            logits_soft_cap: the layer's soft cap (passed only when set, and only to a
                backend with :attr:`supports_logits_soft_cap`): each score ``s = scale *
                q.k`` becomes ``cap * tanh(s / cap)`` before masking and the softmax.

        Returns:
            ``[num_tokens, num_heads, head_dim]``: each query attends causally to its own
            sequence's context (cached tokens and new tokens up to and including itself,
            the last ``sliding_window`` of them when windowed).
        """
