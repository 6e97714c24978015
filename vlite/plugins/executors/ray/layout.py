"""What each rank of the ``ray`` executor does, by its global rank.

Ranks are numbered stage by stage: ``rank = pipeline_stage * tensor_parallel_size +
tensor_parallel_rank``. Placement-group bundle ``i`` holds rank ``i``, and rank 0 hosts
the ``torch.distributed`` rendezvous. One rank, the first of the last stage (which holds
the logits and samples), sends the step's tokens back to the engine; every rank samples the
same tokens, so the others send nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

from vlite.core.errors import ConfigError


@dataclass(frozen=True)
class RankRole:
    """One rank's place in the executor.

    Attributes:
        rank: the global rank (also its bundle index in the placement group).
        tensor_parallel_rank: its rank inside its stage's tensor-parallel group.
        pipeline_stage: which run of layers it holds (0 while there is one stage).
        returns_output: whether its step results travel back to the engine.
    """

    rank: int
    tensor_parallel_rank: int
    pipeline_stage: int
    returns_output: bool


def rank_roles(tensor_parallel_size: int, pipeline_parallel_size: int = 1) -> list[RankRole]:
    """Every rank's role, in global rank order."""
    for name, size in (
        ("tensor_parallel_size", tensor_parallel_size),
        ("pipeline_parallel_size", pipeline_parallel_size),
    ):
        if size < 1:
            raise ConfigError(f"{name}={size}; expected 1 or more")
    last_stage = pipeline_parallel_size - 1
    return [
        RankRole(
            rank=stage * tensor_parallel_size + tp_rank,
            tensor_parallel_rank=tp_rank,
            pipeline_stage=stage,
            returns_output=stage == last_stage and tp_rank == 0,
        )
        for stage in range(pipeline_parallel_size)
        for tp_rank in range(tensor_parallel_size)
    ]
