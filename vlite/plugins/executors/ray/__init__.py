"""``ray``: one Ray actor per rank, tensor parallel, on one machine or a Ray cluster.

Ray is optional (``pip install "vlite[ray]"``): this package imports it only when the
executor is constructed, so registering the plugin, and ``import vlite``, never do.

- :mod:`.session`: importing Ray and sharing this process's connection to it.
- :mod:`.layout`: what each rank does (its role), in the order ranks are numbered.
- :mod:`.placement`: the placement group that reserves one bundle per rank.
- :mod:`.rank_actor`: the code inside each rank's actor (the same ``Worker`` as
  ``multiproc``'s processes).
- :mod:`.rank_group`: the engine's side of the actors: start, call, watch, stop.
- :mod:`.failures`: how a Ray error becomes an error naming the rank and its node.
- :mod:`.pending_step`: the future of a step in flight.
- :mod:`.executor`: the :class:`~vlite.core.executor.Executor` itself.
"""

from __future__ import annotations

from vlite.core.hookspecs import hookimpl
from vlite.plugins.executors.ray.executor import RayExecutor

__all__ = ["RayExecutor", "register_executors"]


@hookimpl
def register_executors(register):
    register("ray", RayExecutor)
