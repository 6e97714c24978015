"""Setting up and tearing down a worker process's ``torch.distributed`` process group.

Ranks meet through a file (``file://`` init method) in a directory the executor creates,
so no TCP port has to be found free in advance; gloo on CPU, NCCL on CUDA.
"""

from __future__ import annotations

import datetime
from pathlib import Path

import torch
import torch.distributed as dist

from vlite.distributed.parallel_state import SINGLE_RANK, TensorParallelGroup

#: How long a collective (and the rendezvous) may wait for the slowest rank.
DEFAULT_TIMEOUT = datetime.timedelta(minutes=10)


def default_backend(device: torch.device) -> str:
    """``"nccl"`` for CUDA devices, ``"gloo"`` otherwise."""
    return "nccl" if device.type == "cuda" else "gloo"


def file_init_method(directory: str | Path) -> str:
    """A ``file://`` init method for a rendezvous file inside ``directory`` (which must exist
    and be fresh: a leftover file from another group breaks the rendezvous)."""
    return (Path(directory).resolve() / "rendezvous").as_uri()


def init_tensor_parallel_group(
    rank: int,
    world_size: int,
    init_method: str,
    device: torch.device,
    timeout: datetime.timedelta = DEFAULT_TIMEOUT,
) -> TensorParallelGroup:
    """Join the default process group as ``rank`` of ``world_size``; its group object.

    At world size 1 no process group is created and :data:`SINGLE_RANK` is returned.
    """
    if world_size == 1:
        return SINGLE_RANK
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend=default_backend(device),
        init_method=init_method,
        rank=rank,
        world_size=world_size,
        timeout=timeout,
    )
    return TensorParallelGroup(rank, world_size, dist.group.WORLD)


def destroy_tensor_parallel_group(group: TensorParallelGroup) -> None:
    """Leave the process group ``group`` belongs to (nothing at world size 1)."""
    if group.is_parallel and dist.is_initialized():
        dist.destroy_process_group()
