"""TensorParallelGroup: a worker's rank, the world size, and the collectives layers call.

The group is handed to the model explicitly (no process-wide global): a layer asks its
own group to all-reduce or all-gather. At world size 1 both are identities that make no
``torch.distributed`` call, so a single-process engine pays nothing for them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from vlite.core.errors import ConfigError


@dataclass(frozen=True)
class TensorParallelGroup:
    """The ranks one model is sharded over.

    Attributes:
        rank: this process's rank, ``0 <= rank < world_size``.
        world_size: how many ranks share the model.
        process_group: the ``torch.distributed`` group; ``None`` at world size 1.
    """

    rank: int = 0
    world_size: int = 1
    process_group: Any = None

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank={self.rank} is outside world_size={self.world_size}")
        if self.world_size > 1 and self.process_group is None:
            raise ValueError(f"world_size={self.world_size} needs a process group")

    @property
    def is_parallel(self) -> bool:
        """Whether there is more than one rank (collectives do something)."""
        return self.world_size > 1

    def shard_range(self, size: int) -> tuple[int, int]:
        """``(start, end)`` of this rank's equal share of ``size`` (``world_size`` divides it)."""
        if size % self.world_size:
            raise ConfigError(f"{size} does not split evenly over {self.world_size} ranks")
        per_rank = size // self.world_size
        return self.rank * per_rank, (self.rank + 1) * per_rank

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the ranks, in place; every rank gets the same values."""
        if self.world_size == 1:
            return tensor
        torch.distributed.all_reduce(tensor, group=self.process_group)
        return tensor

    def all_gather(self, tensor: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's ``tensor`` (same shape on all) along ``dim``, in rank order."""
        if self.world_size == 1:
            return tensor
        tensor = tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        torch.distributed.all_gather(parts, tensor, group=self.process_group)
        return torch.cat(parts, dim=dim)


#: The group of a model that is not sharded.
SINGLE_RANK = TensorParallelGroup()
