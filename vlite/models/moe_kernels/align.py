"""Token-expert pairs grouped by expert into blocks of ``block_m`` rows, with torch ops.

A step routes ``T`` tokens to ``top_k`` experts each: ``P = T * top_k`` pairs, pair ``p``
being token ``p // top_k``'s ``p % top_k``-th choice. The grouped GEMM gives each program
one block of ``block_m`` rows that all belong to one expert, so :func:`align_pairs_to_blocks`
sorts the pairs by expert and pads each expert's run to a multiple of ``block_m`` with the
padding id ``P``. Unused blocks at the end hold only padding and the expert
``num_experts``.

The alignment is the same on every rank: experts are numbered globally, and the kernel
skips (or zeroes) the blocks of experts another rank holds.

The block count is bounded on the host from shapes alone, so nothing waits for the device:
each of the ``num_experts`` runs pads by fewer than ``block_m`` rows, and no used block is
empty. It takes a fixed, small number of torch operations (each costs host time on a GPU).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ExpertBlocks:
    """The pairs of a step in blocks of one expert each.

    Attributes:
        pair_ids: ``[num_blocks * block_m]`` int64, the pair of each block row, sorted by
            expert; ``num_pairs`` pads.
        block_experts: ``[num_blocks]`` int32, each block's expert (global numbering);
            ``num_experts`` for the unused blocks.
        block_m: rows per block.
        num_pairs: ``P``, tokens times ``top_k``.
    """

    pair_ids: torch.Tensor
    block_experts: torch.Tensor
    block_m: int
    num_pairs: int

    @property
    def num_blocks(self) -> int:
        return self.block_experts.shape[0]


def max_num_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """An upper bound of the blocks ``num_pairs`` pairs over ``num_experts`` experts fill."""
    return min(num_pairs, (num_pairs + num_experts * (block_m - 1)) // block_m)


def align_pairs_to_blocks(
    pair_experts: torch.Tensor, num_experts: int, block_m: int
) -> ExpertBlocks:
    """Group the pairs by expert into blocks of ``block_m`` rows.

    Args:
        pair_experts: ``[P]`` int64, each pair's expert (``routed_experts.flatten()``).
        num_experts: experts of the layer (all ranks together).
        block_m: rows per block.
    """
    device = pair_experts.device
    num_pairs = pair_experts.shape[0]
    sorted_experts, order = torch.sort(pair_experts, stable=True)
    experts = torch.arange(num_experts, device=device)
    run_starts = torch.searchsorted(sorted_experts, experts)  # [E], in sorted order
    run_ends = torch.searchsorted(sorted_experts, experts, right=True)
    blocks_per_expert = (run_ends - run_starts + (block_m - 1)) // block_m
    block_ends = torch.cumsum(blocks_per_expert, 0)
    # Sorted pair i of expert e goes to row padded_start[e] + (i - run_starts[e]).
    shifts = (block_ends - blocks_per_expert) * block_m - run_starts
    rows = torch.arange(num_pairs, device=device) + shifts[sorted_experts]

    num_blocks = max_num_blocks(num_pairs, num_experts, block_m)
    pair_ids = torch.full((num_blocks * block_m,), num_pairs, dtype=torch.int64, device=device)
    pair_ids[rows] = order
    block_indices = torch.arange(num_blocks, device=device)
    block_experts = torch.searchsorted(block_ends, block_indices, right=True, out_int32=True)
    return ExpertBlocks(pair_ids, block_experts, block_m, num_pairs)
