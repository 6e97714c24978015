"""Tensor-parallel ranks in one process, for tests of how layers split their weights."""

from __future__ import annotations

import torch

from vlite.distributed.parallel_state import TensorParallelGroup


class LocalOnlyGroup(TensorParallelGroup):
    """Rank ``rank`` of ``world_size`` whose collectives return the local tensor (a test
    combines the ranks' partial results itself)."""

    def __init__(self, rank: int, world_size: int) -> None:
        super().__init__(rank, world_size, process_group="not used")

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return tensor


def ranks(world_size: int) -> list[TensorParallelGroup]:
    """Every rank of a ``world_size`` group, as :class:`LocalOnlyGroup` s."""
    return [LocalOnlyGroup(rank, world_size) for rank in range(world_size)]
