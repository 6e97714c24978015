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


# ---- sharing the machine ----------------------------------------------------------------


def read_cpu_times() -> tuple[float, float, float]:
    """``(busy, total)`` jiffies of all CPUs (``/proc/stat``) and this process's own
    (``/proc/self/stat``: user + system time of all its threads), in clock ticks."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    values = [float(v) for v in fields]
    idle = values[3] + (values[4] if len(values) > 4 else 0.0)  # idle + iowait
    total = sum(values[:8])  # guest time is already inside user/nice
    stat = Path("/proc/self/stat").read_text()
    own = stat[stat.rindex(")") + 2 :].split()  # fields after the command name
    return total - idle, total, float(own[11]) + float(own[12])  # utime, stime


class ThreadGovernor:
    """Gives cores back when other processes are using them, and takes them back after.

    An OpenMP team waits at every parallel region for its slowest thread; when another
    process runs on one of the team's cores, that thread gets a fraction of the core and
    every region stalls on it. Every ``interval_s`` seconds (checked once per step, so it
    costs nothing between checks) the governor reads how many cores processes other than
    this one kept busy since the last check and sets the thread count to ``max_threads``
    less those cores (rounded; at least one thread).

    Args:
        max_threads: the thread count on an otherwise idle machine.
        num_cpus: logical CPUs in ``/proc/stat``'s totals (default: all of them).
        read_times: :func:`read_cpu_times` (tests pass their own).
        clock: seconds, monotonic.
    """

    def __init__(
        self,
        max_threads: int,
        *,
        interval_s: float = 2.0,
        num_cpus: int | None = None,
        read_times=read_cpu_times,
        clock=None,
    ) -> None:
        import time

        self.max_threads = max_threads
        self.interval_s = interval_s
        self.num_cpus = num_cpus or os.cpu_count() or 1
        self._read_times = read_times
        self._clock = clock or time.monotonic
        self._last_time = self._clock()
        self._last_sample = read_times()
        #: Cores other processes kept busy over the last interval.
        self.other_load = 0.0
        self.threads = max_threads

    def on_step(self) -> None:
        """Called before each step: re-evaluates at most once per ``interval_s``."""
        now = self._clock()
        if now - self._last_time < self.interval_s:
            return
        sample = self._read_times()
        busy, total, own = (new - old for new, old in zip(sample, self._last_sample))
        self._last_time, self._last_sample = now, sample
        if total <= 0:
            return
        # /proc/stat counts all CPUs; our own ticks come from /proc/self/stat.
        self.other_load = max(0.0, (busy - own) / total * self.num_cpus)
        threads = max(1, min(self.max_threads, self.max_threads - round(self.other_load)))
        if threads != self.threads:
            self.threads = threads
            use_cpu_threads(threads)
