"""How many CPU threads a worker computes with, and the OpenMP environment it runs in.

Default: one intra-op thread per *physical* core this process may run on (a second
hyperthread of a core adds contention, not bandwidth), shared evenly by the workers of a
tensor-parallel group. ``cpu_threads`` (config, ``VLITE_CPU_THREADS``, ``--cpu-threads``)
sets the count per worker. ``vlite serve`` leaves one core to its API process on machines
with at least four cores.

Worker processes inherit :func:`thread_environment`: ``OMP_NUM_THREADS`` and
``MKL_NUM_THREADS`` fix the team size before PyTorch starts its OpenMP runtime, which PyTorch
and vlite's C kernels share.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch


def usable_cpus() -> set[int]:
    """The logical CPUs this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return set(os.sched_getaffinity(0))
    return set(range(os.cpu_count() or 1))


def physical_cores(cpus: set[int] | None = None) -> int:
    """How many distinct physical cores ``cpus`` (default: :func:`usable_cpus`) span.

    Read from ``/sys/devices/system/cpu/cpuN/topology``; where that is absent, every
    logical CPU counts as a core.
    """
    cpus = usable_cpus() if cpus is None else cpus
    cores = set()
    for cpu in cpus:
        topology = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            package = (topology / "physical_package_id").read_text().strip()
            core = (topology / "core_id").read_text().strip()
        except OSError:
            return len(cpus)
        cores.add((package, core))
    return max(1, len(cores))


def default_cpu_threads(num_workers: int = 1, reserved_cores: int = 0) -> int:
    """Physical cores less ``reserved_cores``, split over ``num_workers``; at least 1."""
    return max(1, (physical_cores() - reserved_cores) // num_workers)


def resolve_cpu_threads(setting: int | None, num_workers: int = 1) -> int:
    """``cpu_threads`` if set, else :func:`default_cpu_threads` for ``num_workers``."""
    return setting if setting is not None else default_cpu_threads(num_workers)


def thread_environment(num_threads: int) -> dict[str, str]:
    """Environment variables that size a child process's thread pools."""
    return {"OMP_NUM_THREADS": str(num_threads), "MKL_NUM_THREADS": str(num_threads)}


def use_cpu_threads(num_threads: int) -> None:
    """Set this process's intra-op thread count (PyTorch's and the C kernels')."""
    if torch.get_num_threads() != num_threads:
        torch.set_num_threads(num_threads)
