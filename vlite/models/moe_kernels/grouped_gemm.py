"""The experts' matrix products as one grouped GEMM over expert-aligned blocks, in Triton.

Grid: ``(blocks, ceil(N / BLOCK_N))``, blocks from
:func:`~vlite.models.moe_kernels.align.align_pairs_to_blocks`. A program loads its block's
expert and ``BLOCK_M`` pair ids, gathers their activation rows (row ``pair //
PAIRS_PER_A_ROW``: the token's hidden state in the first launch, the pair's own row in the
second), multiplies them by ``BLOCK_N`` rows of that expert's weight ``BLOCK_K`` columns at
a time (products in float32; float32 operands exactly, never rounded to tf32), and stores
``BLOCK_M x BLOCK_N`` outputs at the pairs' rows. Padding rows store nothing.

Two variants, by constexpr:

- ``GATED`` (``hidden x w13``): two accumulators, the gate rows ``n`` and the up rows
  ``up_row_offset + n`` of the weight, stored as ``SiLU(gate) * up``;
- ``WEIGHTED`` (``activations x w2``): each row scaled by its pair's routed weight.

A block of an expert outside ``[first_expert, first_expert + num_local_experts)`` (another
rank's, or ``num_experts`` for an unused block) stores zeros when ``ZERO_UNROUTED`` (so a
per-token sum over the output needs no mask), otherwise nothing. ``K`` is a constexpr (a
layer has two: hidden and intermediate), which keeps the K loop's bounds static.

As the attention kernels, these call only builtins of ``triton.language`` (``tl.full``
for ``tl.zeros``, ``exp`` for ``tl.sigmoid``), so they run under the interpreter even when
``triton`` was imported before ``TRITON_INTERPRET=1`` was set. Import this module through
:func:`vlite.models.moe_kernels.load_moe_kernels`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vlite.models.moe_kernels.align import ExpertBlocks
from vlite.models.moe_kernels.config import MoETiles


@triton.jit
def _multiply_accumulate(acc, a, w, DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr):
    """``acc + a @ w``, ``acc`` float32 ``[BLOCK_M, BLOCK_N]``."""
    if UPCAST_DOT:
        a = a.to(tl.float32)
        w = w.to(tl.float32)
    return tl.dot(a, w, acc, input_precision=DOT_PRECISION)


@triton.jit
def _grouped_gemm_kernel(
    a_ptr,  # [rows, K], last dimension contiguous
    w_ptr,  # [num_local_experts, weight rows, K], last dimension contiguous
    out_ptr,  # [num_pairs, N], last dimension contiguous
    pair_ids_ptr,  # [num_blocks * BLOCK_M] int64, num_pairs pads
    block_experts_ptr,  # [num_blocks] int32, global expert numbers
    routed_weights_ptr,  # [num_pairs] float32 (WEIGHTED only)
    num_pairs,
    N,
    first_expert,
    num_local_experts,
    up_row_offset,  # GATED: the first up row of an expert's weight
    stride_a_row,
    stride_w_expert,
    stride_w_row,
    stride_out_row,
    K: tl.constexpr,
    PAIRS_PER_A_ROW: tl.constexpr,
    GATED: tl.constexpr,
    WEIGHTED: tl.constexpr,
    ZERO_UNROUTED: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):
    block = tl.program_id(0)
    pairs = tl.load(pair_ids_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    row_valid = pairs < num_pairs
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_valid = cols < N
    out_ptrs = out_ptr + pairs[:, None] * stride_out_row + cols[None, :]
    out_mask = row_valid[:, None] & col_valid[None, :]

    expert = tl.load(block_experts_ptr + block).to(tl.int64) - first_expert  # local index
    if (expert < 0) | (expert >= num_local_experts):
        if ZERO_UNROUTED:
            zeros = tl.full((BLOCK_M, BLOCK_N), 0.0, dtype=out_ptr.dtype.element_ty)
            tl.store(out_ptrs, zeros, mask=out_mask)
        return

    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + (pairs // PAIRS_PER_A_ROW)[:, None] * stride_a_row + offs_k[None, :]
    # The weight tile as [BLOCK_K, BLOCK_N]: expert rows n, their columns k.
    w_ptrs = w_ptr + expert * stride_w_expert + cols[None, :] * stride_w_row + offs_k[:, None]
    up_shift = up_row_offset * stride_w_row
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, dtype=tl.float32)
    acc_up = tl.full((BLOCK_M, BLOCK_N), 0.0, dtype=tl.float32)
    for k_start in range(0, K, BLOCK_K):
        k_valid = offs_k < K - k_start
        a = tl.load(a_ptrs, mask=row_valid[:, None] & k_valid[None, :], other=0.0)
        w_mask = k_valid[:, None] & col_valid[None, :]
        acc = _multiply_accumulate(
            acc, a, tl.load(w_ptrs, mask=w_mask, other=0.0), DOT_PRECISION, UPCAST_DOT
        )
        if GATED:
            w_up = tl.load(w_ptrs + up_shift, mask=w_mask, other=0.0)
            acc_up = _multiply_accumulate(acc_up, a, w_up, DOT_PRECISION, UPCAST_DOT)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K

    if GATED:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up  # SiLU(gate) * up
    if WEIGHTED:
        routed = tl.load(routed_weights_ptr + pairs, mask=row_valid, other=0.0)
        acc = acc * routed[:, None]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=out_mask)


def is_interpreted() -> bool:
    """Whether this module's kernel runs under the Triton interpreter."""
    return type(_grouped_gemm_kernel).__name__ == "InterpretedFunction"


def _last_dim_contiguous(tensor: torch.Tensor) -> torch.Tensor:
    return tensor if tensor.stride(-1) == 1 else tensor.contiguous()


def grouped_gemm(
    a: torch.Tensor,
    weight: torch.Tensor,
    out: torch.Tensor,
    blocks: ExpertBlocks,
    tiles: MoETiles,
    *,
    first_expert: int,
    pairs_per_a_row: int,
    gated: bool = False,
    routed_weights: torch.Tensor | None = None,
    zero_unrouted: bool = False,
) -> torch.Tensor:
    """``out[p] = a[p // pairs_per_a_row] @ weight[expert(p) - first_expert].T`` for every
    pair ``p`` routed to a local expert (see the module docstring for the variants).

    Args:
        a: ``[rows, K]`` activations (tokens for the first launch, pairs for the second).
        weight: ``[num_local_experts, N, K]``, or ``[num_local_experts, 2 * N, K]`` (gate
            rows, then up rows) when ``gated``: experts ``first_expert`` onwards.
        out: ``[num_pairs, N]``, written in place at the locally routed pairs' rows (and
            with zeros at the others' when ``zero_unrouted``); other rows are untouched.
        blocks: the pairs aligned to ``tiles.block_m``-row blocks.
        tiles: the tile sizes (``tiles.block_m == blocks.block_m``).
        pairs_per_a_row: ``top_k`` when ``a`` holds tokens, 1 when it holds pairs.
        routed_weights: ``[num_pairs]`` float32 to scale each pair's row by, or ``None``.

    Returns:
        ``out``.
    """
    if tiles.block_m != blocks.block_m:
        raise ValueError(f"tiles.block_m={tiles.block_m} but the blocks have {blocks.block_m}")
    if out.stride(-1) != 1:
        raise ValueError("out must have a contiguous last dimension")
    if blocks.num_blocks == 0:
        return out
    a = _last_dim_contiguous(a)
    weight = _last_dim_contiguous(weight)
    n = out.shape[1]
    k = a.shape[1]
    # The interpreter (Triton 3.x) multiplies bfloat16 tiles wrongly; it gets float32 tiles
    # holding the same values (products exact, sums in float32, as on a GPU).
    upcast_dot = is_interpreted() and a.dtype != torch.float32
    grid = (blocks.num_blocks, triton.cdiv(n, tiles.block_n))
    _grouped_gemm_kernel[grid](
        a,
        weight,
        out,
        blocks.pair_ids,
        blocks.block_experts,
        routed_weights if routed_weights is not None else out,
        blocks.num_pairs,
        n,
        first_expert,
        weight.shape[0],
        n if gated else 0,
        a.stride(0),
        weight.stride(0),
        weight.stride(1),
        out.stride(0),
        K=k,
        PAIRS_PER_A_ROW=pairs_per_a_row,
        GATED=gated,
        WEIGHTED=routed_weights is not None,
        ZERO_UNROUTED=zero_unrouted,
        BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n,
        BLOCK_K=tiles.block_k,
        # float32 operands must not be rounded to tf32: float32 is the correctness dtype.
        DOT_PRECISION="ieee" if a.dtype == torch.float32 or upcast_dot else "tf32",
        UPCAST_DOT=upcast_dot,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )
    return out
