"""Tensor parallelism over ``torch.distributed``: the group a model shards itself over,
its collectives, and the process-group set-up of a worker process."""

from vlite.distributed.parallel_state import SINGLE_RANK, TensorParallelGroup
from vlite.distributed.process_group import (
    default_backend,
    destroy_tensor_parallel_group,
    file_init_method,
    init_tensor_parallel_group,
)

__all__ = [
    "SINGLE_RANK",
    "TensorParallelGroup",
    "default_backend",
    "destroy_tensor_parallel_group",
    "file_init_method",
    "init_tensor_parallel_group",
]
