"""The native CPU attention backend (registry name ``cpu``): paged attention in C.

One call per layer writes the step's keys and values into the paged cache and attends
every new token to its own sequence's context, reading the cache blocks in place: no
per-step gather of the contexts, no padding to the longest one, no mask tensors. Prefills,
prompt chunks, prefix-cache hits and decodes are one code path (each token sees keys
``0..position``). The kernel (``vlite/kernels/paged_attention.c``) is compiled on first use
(:mod:`vlite.kernels.native`); it computes in float32, with an online softmax rescaled once
per cache block, so its results match the ``torch`` reference to float32 rounding, not bit
for bit. A windowed layer's tokens start at their window's first key. The cache may hold
float16 (``kv_cache_dtype``; the default for GGUF models computing in float32): keys and
values are rounded to it as they are written, and read back as float32. Each token's keys
are taken in chunks of 256 at fixed positions and folded in order (spread over the threads
when a step has few tokens), so a token's result does not depend on its batch.

``auto`` prefers it on the CPU for float32 models; bfloat16/float16 stay with ``torch``.
"""

from __future__ import annotations

from typing import Any

import torch

from vlite.core.attention import AttentionBackend, AttentionMetadata
from vlite.core.errors import ConfigError
from vlite.core.hookspecs import Register, hookimpl

#: Query heads per KV head times head dim that the kernel's buffers hold.
_MAX_GROUP_VALUES = 8192


class CpuAttentionBackend(AttentionBackend):
    """Paged causal attention with grouped-query support, in C, float32 on the CPU."""

    supported_dtypes = (torch.float32,)
    supported_block_sizes = (16, 32, 64)
    supports_sliding_window = True
    supports_logits_soft_cap = True  # through the torch reference
    kv_cache_dtypes = (torch.float16,)

    def __init__(
        self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, block_size: int
    ) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, scale, block_size)
        if self.num_queries_per_kv > 64 or self.num_queries_per_kv * head_dim > _MAX_GROUP_VALUES:
            raise ConfigError(
                f"the cpu attention backend supports at most 64 query heads per KV head and "
                f"{_MAX_GROUP_VALUES} values per KV-head group; got {self.num_queries_per_kv} "
                f"x head dim {head_dim}"
            )
        from vlite.kernels.native import paged_attention_kernel

        self._kernel = paged_attention_kernel()
        # The step's checked cache layout, made by the first layer to see its metadata.
        self._step_metadata: AttentionMetadata | None = None
        self._step: Any = None

    def _reference(self) -> AttentionBackend:
        from vlite.plugins.attention.torch_ref import TorchAttentionBackend

        if not hasattr(self, "_torch"):
            self._torch = TorchAttentionBackend(
                self.num_heads, self.num_kv_heads, self.head_dim, self.scale, self.block_size
            )
        return self._torch

    @classmethod
    def unavailable_reason(cls, device: torch.device, dtype: torch.dtype) -> str | None:
        """Why the backend cannot run here (``None``: it can)."""
        if device.type != "cpu":
            return f"the C kernel runs on the CPU, not {device.type}"
        from vlite.kernels.native import unavailable_reason

        return unavailable_reason()

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
        """See :meth:`AttentionBackend.forward`. Returns ``[num_tokens, num_heads, head_dim]``.

        Queries that are not float32 and a cache that is neither float32 nor float16 on the
        CPU (e.g. when ``auto`` is constructed directly and then fed bfloat16), and a
        soft-capped layer (the kernel has no cap), go to the ``torch`` reference instead.
        """
        if (
            query.dtype != torch.float32
            or kv_cache.dtype not in (torch.float32, torch.float16)
            or kv_cache.device.type != "cpu"
            or logits_soft_cap is not None
        ):
            return self._reference().forward(
                query,
                key,
                value,
                kv_cache,
                metadata,
                sliding_window=sliding_window,
                logits_soft_cap=logits_soft_cap,
            )
        if metadata is not self._step_metadata:  # the first layer of a step
            self._step = self._kernel.step(
                metadata.slot_mapping,
                metadata.block_tables,
                metadata.seq_lens,
                metadata.query_start_loc,
                self.scale,
            )
            self._step_metadata = metadata
        query, key, value = (_float32_rows(t) for t in (query, key, value))
        return self._step(query, key, value, kv_cache, sliding_window)


def _float32_rows(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as float32 with unit stride within a head (no copy when it already is)."""
    if tensor.dtype != torch.float32:
        tensor = tensor.float()
    return tensor if tensor.stride(-1) == 1 else tensor.contiguous()


@hookimpl
def register_attention_backends(register: Register) -> None:
    register("cpu", CpuAttentionBackend)
