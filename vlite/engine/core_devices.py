"""Which GPUs each data-parallel engine core gets.

Every core is a whole engine: it sizes its KV cache from its devices' free memory, so two
cores must not share a GPU. Core ``i`` of a local data-parallel server gets the ``i``-th run
of ``devices_per_core`` devices among those this process sees (``CUDA_VISIBLE_DEVICES`` if
set, else ``0 .. device_count-1``), as its own ``CUDA_VISIBLE_DEVICES``; its workers then
number their devices from 0 as they do without data parallelism.
"""

from __future__ import annotations

from vlite.core.errors import ConfigError


def visible_device_ids(visible: str | None, device_count: int) -> list[str]:
    """The device ids this process may use: ``CUDA_VISIBLE_DEVICES``'s entries (ids or
    UUIDs, as written) when it is set, else ``"0" .. str(device_count - 1)``."""
    if visible is None:
        return [str(index) for index in range(device_count)]
    return [entry.strip() for entry in visible.split(",") if entry.strip()]


def split_devices(num_cores: int, devices_per_core: int, device_ids: list[str]) -> list[str]:
    """Each core's ``CUDA_VISIBLE_DEVICES``: consecutive runs of ``devices_per_core`` ids.

    Raises:
        ValueError: fewer ids than ``num_cores * devices_per_core``; the message names the
            sizes and the devices seen.
    """
    needed = num_cores * devices_per_core
    if len(device_ids) < needed:
        seen = ",".join(device_ids) or "none"
        raise ConfigError(
            f"data_parallel_size {num_cores} x {devices_per_core} GPU(s) per engine core "
            f"(tensor_parallel_size x pipeline_parallel_size) needs {needed} GPUs, but "
            f"{len(device_ids)} are visible ({seen}); lower data_parallel_size or make more "
            "GPUs visible (CUDA_VISIBLE_DEVICES)"
        )
    return [
        ",".join(device_ids[core * devices_per_core : (core + 1) * devices_per_core])
        for core in range(num_cores)
    ]
