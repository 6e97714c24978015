"""The placement group that reserves one bundle of resources per rank.

A bundle is ``{"CPU": threads}`` on CPU, ``{"GPU": 1}`` on CUDA, plus the custom resources of
``ray_bundle_resources``. The group's strategy (``ray_placement_strategy``) decides how
bundles go over nodes; a custom resource that each chosen node has once puts one rank on
each. Reserving fails, with the bundles and the cluster's free resources in the message,
when the cluster cannot hold them in :data:`PLACEMENT_TIMEOUT_S`.
"""

from __future__ import annotations

import math
from typing import Any

from vlite.core.errors import ConfigError, VliteError
from vlite.plugins.executors.ray.session import import_ray

#: How long the cluster may take to reserve every bundle (an autoscaler may add nodes).
PLACEMENT_TIMEOUT_S = 60.0
#: Resources the executor sizes itself: ``ray_bundle_resources`` may not name them.
RESOURCES_SET_BY_VLITE = ("CPU", "GPU")


class RayPlacementError(VliteError, RuntimeError):
    """The Ray cluster could not reserve the ranks' bundles."""


def parse_bundle_resources(entries: tuple[str, ...]) -> dict[str, float]:
    """``("node_a=1", "ssd=0.5")`` -> ``{"node_a": 1.0, "ssd": 0.5}``.

    Raises:
        ValueError: an entry that is not ``NAME=AMOUNT`` with a positive amount, or that
            names CPU or GPU; the message names the entry.
    """
    resources: dict[str, float] = {}
    for entry in entries:
        name, sep, amount_text = entry.partition("=")
        name = name.strip()
        try:
            amount = float(amount_text)
        except ValueError:
            amount = math.nan
        if not sep or not name or not amount > 0 or math.isinf(amount):
            raise ConfigError(
                f"ray_bundle_resources entry {entry!r} is not NAME=AMOUNT with a positive "
                "amount (e.g. 'node_a=1')"
            )
        if name in RESOURCES_SET_BY_VLITE:
            raise ConfigError(
                f"ray_bundle_resources entry {entry!r} names {name}, which the executor sets "
                "itself (cpu_threads per rank on CPU, one GPU per rank on CUDA); name a "
                "custom resource instead"
            )
        resources[name] = amount
    return resources


def rank_bundle(device_type: str, num_threads: int, custom: dict[str, float]) -> dict[str, float]:
    """The resources one rank's bundle reserves."""
    own = {"GPU": 1.0} if device_type == "cuda" else {"CPU": float(num_threads)}
    return {**own, **custom}


def reserve_bundles(bundles: list[dict[str, float]], strategy: str) -> Any:
    """A ready placement group of ``bundles`` (bundle ``i`` for rank ``i``).

    Raises:
        RayPlacementError: not reserved within :data:`PLACEMENT_TIMEOUT_S` (the group is
            removed again).
    """
    ray = import_ray()
    from ray.util.placement_group import placement_group, remove_placement_group

    group = placement_group(bundles, strategy=strategy)
    ready, _ = ray.wait([group.ready()], timeout=PLACEMENT_TIMEOUT_S)
    if not ready:
        remove_placement_group(group)
        raise RayPlacementError(
            f"the Ray cluster did not reserve {len(bundles)} bundles {bundles} with strategy "
            f"{strategy} in {PLACEMENT_TIMEOUT_S:g} s; its free resources: "
            f"{_free_resources(ray)}. Lower cpu_threads, add nodes, or change "
            "ray_placement_strategy or ray_bundle_resources"
        )
    return group


def _free_resources(ray: Any) -> dict[str, float]:
    """The cluster's free resources, without Ray's per-node bookkeeping entries."""
    return {
        name: amount
        for name, amount in sorted(ray.available_resources().items())
        if not name.startswith("node:") and name not in ("memory", "object_store_memory")
    }
