"""Pipeline parallelism: a worker's stage, its layers, and the hand-off between stages.

``tensor_parallel_size x pipeline_parallel_size`` ranks: global rank ``stage * tp +
tp_rank``. Each stage is a tensor-parallel group of ``tp`` ranks holding a contiguous run
of the model's layers (the embedding on the first stage, the final norm and LM head on the
last). After a stage's last layer every one of its ranks holds the same hidden states (the
all-reduces make them identical), so tensor-parallel rank ``i`` of stage ``s`` sends them
point to point to rank ``i`` of stage ``s + 1``.

Layers are split by :func:`~vlite.core.model_split.stage_layer_ranges` (in the core, which
checks the split before any worker starts): equal runs, the first ``num_layers % pp``
stages taking one more (the last stage also runs the LM head and the sampler), or an
explicit partition (``pp_layer_partition``, e.g. ``5,5,4``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from vlite.core.model_split import stage_layer_ranges
from vlite.distributed.parallel_state import SINGLE_RANK, TensorParallelGroup


@dataclass(frozen=True)
class PipelineParallelGroup:
    """One worker's place in the pipeline.

    Attributes:
        stage: this worker's stage, ``0 <= stage < num_stages``.
        num_stages: the pipeline's depth (``pipeline_parallel_size``).
        prev_rank, next_rank: global ranks of the counterpart in the stages before and
            after (``None`` at the ends).
        layer_partition: layers per stage as the user set them (``None``: the rule of
            :func:`stage_layer_ranges`).
    """

    stage: int = 0
    num_stages: int = 1
    prev_rank: int | None = None
    next_rank: int | None = None
    layer_partition: tuple[int, ...] | None = None

    def layer_range(self, num_layers: int) -> tuple[int, int]:
        """``(start, end)``: the layers of this stage."""
        return stage_layer_ranges(num_layers, self.num_stages, self.layer_partition)[self.stage]

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1

    def send(self, tensors: list[torch.Tensor]) -> None:
        """Hand ``tensors`` to the next stage, in order (blocking)."""
        for tensor in tensors:
            dist.send(tensor.contiguous(), dst=self.next_rank)

    def recv(
        self, count: int, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> list[torch.Tensor]:
        """Receive ``count`` tensors of ``shape`` from the stage before (blocking)."""
        tensors = []
        for _ in range(count):
            tensor = torch.empty(shape, dtype=dtype, device=device)
            dist.recv(tensor, src=self.prev_rank)
            tensors.append(tensor)
        return tensors


#: The pipeline of a model that is not split into stages.
SINGLE_STAGE = PipelineParallelGroup()


def split_global_rank(rank: int, tensor_parallel_size: int) -> tuple[int, int]:
    """``(stage, tp_rank)`` of a global rank."""
    return divmod(rank, tensor_parallel_size)


def build_parallel_groups(
    rank: int,
    tensor_parallel_size: int,
    pipeline_parallel_size: int,
    layer_partition: tuple[int, ...] | None = None,
) -> tuple[TensorParallelGroup, PipelineParallelGroup]:
    """This rank's tensor-parallel group and pipeline place, in an initialised default
    process group of ``tp * pp`` ranks (``torch.distributed`` must be set up already when
    there is more than one rank).

    Every rank creates every stage's tensor-parallel group, in the same order, as
    ``torch.distributed.new_group`` requires.
    """
    tp, pp = tensor_parallel_size, pipeline_parallel_size
    stage, tp_rank = split_global_rank(rank, tp)
    tp_group = SINGLE_RANK
    if tp > 1 and pp == 1:
        tp_group = TensorParallelGroup(tp_rank, tp, dist.group.WORLD)
    elif tp > 1:
        for each_stage in range(pp):
            group = dist.new_group(list(range(each_stage * tp, (each_stage + 1) * tp)))
            if each_stage == stage:
                tp_group = TensorParallelGroup(tp_rank, tp, group)
    if pp == 1:
        return tp_group, SINGLE_STAGE
    pipeline = PipelineParallelGroup(
        stage,
        pp,
        prev_rank=rank - tp if stage > 0 else None,
        next_rank=rank + tp if stage < pp - 1 else None,
        layer_partition=layer_partition,
    )
    return tp_group, pipeline
