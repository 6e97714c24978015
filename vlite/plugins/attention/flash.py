"""The FlashAttention backend (registry name ``flash``).

- On CUDA: the ``flash-attn`` package's varlen kernel, ``flash_attn_varlen_func``. Its
  ``causal=True`` aligns the mask to the bottom-right when a sequence has fewer queries
  than keys (flash-attn >= 2.1), which is exactly "the queries are the last ``query_len``
  positions of the context", so prefills, cached-prefix prefills and decodes go in one
  call. With a block size that is a multiple of 256 (flash-attn's page-size rule) it reads
  the paged cache in place through ``block_table``; with smaller blocks it first gathers
  each context into a contiguous varlen key/value tensor (one indexed copy, no host sync).
  flash-attn computes in float16/bfloat16 only.
- On CPU: PyTorch's flash SDPA kernel (``SDPBackend.FLASH_ATTENTION``, in PyTorch's CPU
  build since 2.2/2.3) over contexts gathered from the paged cache, batched as the
  ``torch`` reference batches them (decodes together, prefills one by one). The kernel is
  forced, never silently replaced by the math fallback: if PyTorch cannot use it for a
  call, the call fails. Checked with PyTorch 2.13 on CPU: float32, bfloat16 and float16;
  boolean masks (padding and bottom-right causal), grouped-query attention
  (``enable_gqa``) and head dims 16-256 all run on the flash kernel.

When neither can run (CUDA without ``flash-attn``, CUDA in float32, a PyTorch without the
CPU kernel, another device), selecting the backend fails with the reason and what to
install, from :meth:`FlashAttentionBackend.unavailable_reason`.
"""

from __future__ import annotations

import functools
import importlib.util

import torch
import torch.nn.functional as F

from vlite.core.attention import AttentionMetadata
from vlite.core.hookspecs import Register, hookimpl
from vlite.plugins.attention.torch_ref import TorchAttentionBackend

#: flash-attn's paged KV cache needs pages (blocks) of a multiple of this many tokens.
FLASH_ATTN_PAGE_MULTIPLE = 256
_FLASH_ATTN_DTYPES = (torch.float16, torch.bfloat16)
_INSTALL_HINT = "pip install flash-attn --no-build-isolation"


@functools.cache
def flash_attn_import_error() -> str | None:
    """Why ``flash_attn`` cannot be imported (``None``: it can); tried once."""
    if importlib.util.find_spec("flash_attn") is None:
        return "the flash-attn package is not installed"
    try:
        import flash_attn  # noqa: F401
    except Exception as exc:  # a broken build raises anything from ImportError to OSError
        return f"the flash-attn package fails to import ({type(exc).__name__}: {exc})"
    return None


@functools.cache
def cpu_flash_sdpa_error() -> str | None:
    """Why PyTorch's flash SDPA kernel cannot run on CPU here (``None``: it can).

    Probed once with a tiny call, since availability depends on how PyTorch was built.
    """
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:
        return f"PyTorch {torch.__version__} has no torch.nn.attention.sdpa_kernel"
    q = torch.zeros(1, 2, 2, 16, dtype=torch.float32, device="cpu")
    kv = torch.zeros(1, 1, 3, 16, dtype=torch.float32, device="cpu")
    mask = torch.ones(2, 3, dtype=torch.bool, device="cpu")
    try:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            F.scaled_dot_product_attention(q, kv, kv, attn_mask=mask, enable_gqa=True)
    except (RuntimeError, TypeError) as exc:
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return f"PyTorch {torch.__version__} cannot run its flash SDPA kernel on CPU ({first_line})"
    return None


class FlashAttentionBackend(TorchAttentionBackend):
    """Causal paged attention on FlashAttention kernels (see the module docstring).

    Cache layout (the base class default): ``[2, num_blocks, block_size, num_kv_heads,
    head_dim]``; ``kv_cache[0]`` is also flash-attn's paged ``k_cache`` layout.

    Limits: head dims that are multiples of 8 up to 256 (flash-attn's rule), any block size;
    float32 on CPU only.
    """

    supported_dtypes = (torch.float32, torch.bfloat16, torch.float16)
    supported_head_dims = tuple(range(8, 257, 8))
    supported_block_sizes = None
    supports_prefix_caching = True
    supports_sliding_window = True
    supports_logits_soft_cap = True

    def __init__(
        self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, block_size: int
    ) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, scale, block_size)
        # Models are built under their device as torch's default device.
        device = torch.get_default_device()
        reason = self.unavailable_reason(device, None)
        if reason is not None:
            raise RuntimeError(f"attention backend 'flash' cannot run on {device}: {reason}")

    @classmethod
    def unavailable_reason(cls, device: torch.device, dtype: torch.dtype | None) -> str | None:
        """Why the backend cannot run on ``device`` in ``dtype`` (``None``: it can)."""
        if device.type == "cuda":
            error = flash_attn_import_error()
            if error is not None:
                return (
                    f"on CUDA it needs flash-attn: {error} ({_INSTALL_HINT}); or use --attn triton"
                )
            if dtype is not None and dtype not in _FLASH_ATTN_DTYPES:
                return (
                    f"flash-attn computes in float16/bfloat16, not {_name(dtype)}; use "
                    "--dtype bfloat16, or --attn triton for float32"
                )
            return None
        if device.type == "cpu":
            error = cpu_flash_sdpa_error()
            if error is not None:
                return f"{error}; upgrade PyTorch (pip install -U torch) or use --attn torch"
            return None
        return f"no FlashAttention kernel for device type {device.type!r}"

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

        On CPU a soft-capped layer computes its scores explicitly as the reference does
        (PyTorch's flash SDPA has no cap)."""
        if query.device.type == "cuda":
            self.write_kv(key, value, kv_cache, metadata.slot_mapping)
            return self._flash_attn_varlen(
                query, kv_cache, metadata, sliding_window, logits_soft_cap
            )
        from torch.nn.attention import SDPBackend, sdpa_kernel

        # The reference's gather-and-SDPA structure, with SDPA pinned to the flash kernel.
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return super().forward(
                query,
                key,
                value,
                kv_cache,
                metadata,
                sliding_window=sliding_window,
                logits_soft_cap=logits_soft_cap,
            )

    def _flash_attn_varlen(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
    ) -> torch.Tensor:
        """flash-attn over the paged cache (in place, or gathered for small blocks); a
        window of ``W`` keys is flash-attn's ``window_size=(W - 1, 0)``, a soft cap its
        ``softcap``."""
        from flash_attn import flash_attn_varlen_func

        key_cache, value_cache = kv_cache[0], kv_cache[1]  # [blocks, block_size, kv_heads, D]
        cu_seqlens_k = torch.zeros(metadata.num_seqs + 1, dtype=torch.int32, device=query.device)
        torch.cumsum(metadata.seq_lens, 0, dtype=torch.int32, out=cu_seqlens_k[1:])
        common = {
            "cu_seqlens_q": metadata.query_start_loc,
            "cu_seqlens_k": cu_seqlens_k,
            "max_seqlen_q": metadata.max_query_len,
            "max_seqlen_k": metadata.max_seq_len,
            "softmax_scale": self.scale,
            "causal": True,
        }
        if sliding_window is not None:
            common["window_size"] = (sliding_window - 1, 0)
        if logits_soft_cap is not None:
            common["softcap"] = logits_soft_cap
        if self.block_size % FLASH_ATTN_PAGE_MULTIPLE == 0:
            return flash_attn_varlen_func(
                query, key_cache, value_cache, block_table=metadata.block_tables, **common
            )
        slots = self._context_slots(metadata, cu_seqlens_k)
        keys = key_cache.reshape(-1, self.num_kv_heads, self.head_dim)[slots]
        values = value_cache.reshape(-1, self.num_kv_heads, self.head_dim)[slots]
        return flash_attn_varlen_func(query, keys, values, **common)

    def _context_slots(
        self, metadata: AttentionMetadata, cu_seqlens_k: torch.Tensor
    ) -> torch.Tensor:
        """``[sum(seq_lens)]`` cache slot of every context token, sequences end to end."""
        device = metadata.seq_lens.device
        total = sum(metadata.seq_lens_cpu)  # host ints: no sync
        seq_index = torch.repeat_interleave(
            torch.arange(metadata.num_seqs, device=device), metadata.seq_lens, output_size=total
        )
        positions = torch.arange(total, device=device) - cu_seqlens_k[seq_index]
        blocks = metadata.block_tables[seq_index, positions // self.block_size].long()
        return blocks * self.block_size + positions % self.block_size


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@hookimpl
def register_attention_backends(register: Register) -> None:
    register("flash", FlashAttentionBackend)
