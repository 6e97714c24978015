"""Setting up and tearing down a worker process's ``torch.distributed`` process group.

Ranks on one machine meet through a file (``file://`` init method, :func:`file_init_method`)
in a directory the executor creates, so no TCP port has to be found free in advance. Ranks
on several machines meet over TCP at rank 0 (:func:`tcp_init_method`, with a port from
:func:`free_tcp_port` run on rank 0's machine). gloo on CPU, NCCL on CUDA.
"""

from __future__ import annotations

import datetime
import socket
from pathlib import Path

import torch
import torch.distributed as dist

from vlite.core.errors import ConfigError
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


def tcp_init_method(host: str, port: int) -> str:
    """A ``tcp://`` init method: rank 0 listens on ``port`` of its machine, reachable at
    ``host`` (an IP address or host name) from every rank; the others connect there."""
    if not 0 < port < 65536:
        raise ConfigError(f"port={port} is not a TCP port; expected 1-65535")
    if not host:
        raise ConfigError("host is empty; expected rank 0's IP address or host name")
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"  # an IPv6 address
    return f"tcp://{host}:{port}"


def free_tcp_port(host: str = "") -> int:
    """A TCP port no socket on this machine is bound to now (the kernel picks it).

    Run it on the machine of the rank that will listen (rank 0), and use the port at once:
    another process may take it in between.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


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
