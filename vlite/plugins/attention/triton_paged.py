"""The Triton paged-attention backend (registry name ``triton``).

Two launches per layer and step, whatever the batch holds:

1. :func:`~vlite.plugins.attention.triton_kernels.write_kv.write_kv` stores the new keys
   and values at their slots;
2. :func:`~vlite.plugins.attention.triton_kernels.paged_attention.paged_attention` attends
   every query token (prefill chunks, cached-prefix prefills and decodes alike) over the
   paged cache; a batch of few sequences is split across more programs (split-K) and
   reduced by a third launch.

No host-device synchronisation: launch sizes come from the metadata's host ints, used as
bounds only, so a decode step can be captured into a CUDA graph (``supports_cuda_graphs``).

On a machine without a CUDA device the kernels run under the Triton interpreter on CPU
tensors (``TRITON_INTERPRET=1``, set by the backend itself, with one warning): correct,
and slow, for tests. CPU tensors in a process with CUDA get a private interpreted copy of
the kernels (see :func:`~vlite.plugins.attention.triton_kernels.load_kernels`). This
module does not import ``triton``; constructing the backend does.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

import torch

from vlite.core.attention import AttentionBackend, AttentionMetadata
from vlite.core.hookspecs import Register, hookimpl

if TYPE_CHECKING:
    from vlite.plugins.attention.triton_kernels import TritonKernels
    from vlite.plugins.attention.triton_kernels.paged_attention import SplitWorkspace


class TritonAttentionBackend(AttentionBackend):
    """Paged causal attention with grouped-query support, in Triton kernels written here.

    Cache layout (the base class default): ``[2, num_blocks, block_size, num_kv_heads,
    head_dim]``, index 0 keys, index 1 values.

    Limits: head dims that are multiples of 16 up to 256 (padded to a power of two inside
    the kernel), block sizes that are powers of two from 16 to 256, float32 (exact float32
    dot products, no tf32), bfloat16 and float16.

    Attributes:
        num_splits: force the split-K factor of every launch (``None``: the heuristic of
            :func:`~vlite.plugins.attention.triton_kernels.config.choose_num_splits`); for
            tests and benchmarks.
    """

    supported_dtypes = (torch.float32, torch.bfloat16, torch.float16)
    supported_head_dims = tuple(range(16, 257, 16))
    supported_block_sizes = (16, 32, 64, 128, 256)
    supports_prefix_caching = True
    supports_sliding_window = True
    supports_logits_soft_cap = True
    supports_cuda_graphs = True

    def __init__(
        self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, block_size: int
    ) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, scale, block_size)
        self.num_splits: int | None = None
        self._kernels: dict[str, TritonKernels] = {}
        self._workspaces: dict[str, SplitWorkspace] = {}
        # Load now (not at the first step) for the device the model is built on, which is
        # torch's default device during construction: errors and the interpreter warning
        # come at engine construction.
        self.kernels_for(torch.get_default_device())

    def kernels_for(self, device: torch.device) -> TritonKernels:
        """The kernels for tensors on ``device``: compiled on CUDA, interpreted on CPU."""
        kernels = self._kernels.get(device.type)
        if kernels is None:
            from vlite.plugins.attention.triton_kernels import load_kernels

            kernels = self._kernels[device.type] = load_kernels(device)
            self._workspaces[device.type] = kernels.new_workspace()
        return kernels

    def _workspace(self, device: torch.device) -> SplitWorkspace | None:
        """The reused split-K buffer, except while a CUDA graph is captured: the graph then
        keeps buffers of its own (from its memory pool), which an eager call growing the
        shared one could not free under it."""
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        return self._workspaces[device.type]

    @classmethod
    def unavailable_reason(cls, device: torch.device, dtype: torch.dtype) -> str | None:
        """Why the backend cannot run on ``device`` (``None``: it can)."""
        # find_spec, not import: importing triton here would come before the backend can
        # set TRITON_INTERPRET=1 for the interpreter on CPU.
        if importlib.util.find_spec("triton") is None:
            return "the triton package is not installed (pip install triton)"
        if device.type not in ("cuda", "cpu"):
            return f"the Triton kernels run on CUDA (or interpreted on CPU), not {device.type}"
        return None

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
        """See :meth:`AttentionBackend.forward`. Returns ``[num_tokens, num_heads, head_dim]``."""
        kernels = self.kernels_for(query.device)
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        kernels.write_kv(key, value, key_cache, value_cache, metadata.slot_mapping)
        return kernels.paged_attention(
            query,
            key_cache,
            value_cache,
            metadata.block_tables,
            metadata.seq_lens,
            metadata.query_start_loc,
            max_query_len=metadata.max_query_len,
            max_seq_len=metadata.max_seq_len,
            scale=self.scale,
            num_splits=self.num_splits,
            workspace=self._workspace(query.device),
            sliding_window=sliding_window,
            logits_soft_cap=logits_soft_cap,
        )


@hookimpl
def register_attention_backends(register: Register) -> None:
    register("triton", TritonAttentionBackend)
