"""Store a step's new keys and values into the paged cache at their slots, in Triton.

Grid: ``(ceil(num_tokens / BLOCK_T),)``. A program copies ``BLOCK_T`` tokens, all KV heads
and the whole head dimension of each (a ``[BLOCK_T, heads * head_dim]`` tile, both padded
to powers of two), converting to the cache's dtype. A negative slot (vLLM's padding
convention) skips its token.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vlite.plugins.attention.triton_kernels.config import next_power_of_2

#: Elements one program moves per tensor: about 4K on a GPU (one token of 8 KV heads x 128
#: dims is 1K) and 16K under the interpreter, whose cost is per program and per op.
_ELEMENTS_PER_PROGRAM = {False: 4096, True: 16384}


@triton.jit
def _write_kv_kernel(
    key_ptr,  # [num_tokens, num_kv_heads, head_dim]
    value_ptr,
    k_cache_ptr,  # [num_blocks, BLOCK_SIZE, num_kv_heads, head_dim]
    v_cache_ptr,
    slot_mapping_ptr,  # [num_tokens] int64
    num_tokens,
    stride_k_token,
    stride_k_head,
    stride_v_token,
    stride_v_head,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    BLOCK_SIZE: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P2: tl.constexpr,
    COLUMNS: tl.constexpr,  # power of two >= NUM_KV_HEADS * HEAD_DIM_P2
    BLOCK_T: tl.constexpr,
):
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    slots = tl.load(slot_mapping_ptr + tokens, mask=tokens < num_tokens, other=-1).to(tl.int64)
    token_valid = (tokens < num_tokens) & (slots >= 0)
    columns = tl.arange(0, COLUMNS)
    head = columns // HEAD_DIM_P2
    dim = columns % HEAD_DIM_P2
    column_valid = (head < NUM_KV_HEADS) & (dim < HEAD_DIM)
    mask = token_valid[:, None] & column_valid[None, :]

    key = tl.load(
        key_ptr + tokens[:, None] * stride_k_token + (head * stride_k_head + dim)[None, :],
        mask=mask,
    )
    value = tl.load(
        value_ptr + tokens[:, None] * stride_v_token + (head * stride_v_head + dim)[None, :],
        mask=mask,
    )
    slot_offset = (slots // BLOCK_SIZE) * stride_cache_block + (slots % BLOCK_SIZE) * (
        stride_cache_slot
    )
    cache_offsets = slot_offset[:, None] + (head * stride_cache_head + dim)[None, :]
    tl.store(k_cache_ptr + cache_offsets, key.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + cache_offsets, value.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store ``key``/``value`` ``[num_tokens, num_kv_heads, head_dim]`` at ``slot_mapping``.

    Args:
        key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, with
            the same strides and a contiguous last dimension.
        slot_mapping: ``[num_tokens]`` int64, ``block_id * block_size + offset``.
    """
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    if key.stride(-1) != 1:
        key = key.contiguous()
    if value.stride(-1) != 1:
        value = value.contiguous()
    if key_cache.stride(-1) != 1 or key_cache.stride() != value_cache.stride():
        raise ValueError("key and value caches must share strides, head_dim contiguous")
    head_dim_p2 = next_power_of_2(head_dim)
    columns = next_power_of_2(num_kv_heads) * head_dim_p2
    interpreted = type(_write_kv_kernel).__name__ == "InterpretedFunction"
    block_t = max(1, _ELEMENTS_PER_PROGRAM[interpreted] // columns)
    block_t = min(block_t, next_power_of_2(num_tokens))
    _write_kv_kernel[(triton.cdiv(num_tokens, block_t),)](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        num_tokens,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        BLOCK_SIZE=key_cache.shape[1],
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        HEAD_DIM_P2=head_dim_p2,
        COLUMNS=columns,
        BLOCK_T=block_t,
        num_warps=4,
    )
