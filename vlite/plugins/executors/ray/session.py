"""Importing Ray, and this process's connection to it, shared by every ``ray`` executor.

A process holds one connection to Ray (``ray.init``). The first executor that finds the
process unconnected connects it, to ``ray_address``; the connection then counts its users,
and when the last one shuts down, vlite disconnects, which also stops a local Ray instance
that ``ray.init`` started. A connection vlite did not make (the user called ``ray.init``
first) is used as it is and left open.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from types import ModuleType

from vlite.core.errors import VliteError

#: How to install what the ``ray`` executor needs.
INSTALL_HINT = 'pip install "vlite[ray]"'


class RayNotInstalledError(VliteError, ImportError):
    """Executor ``ray`` was chosen but Ray cannot be imported."""


def import_ray() -> ModuleType:
    """The ``ray`` module, or :class:`RayNotInstalledError` naming the extra to install."""
    try:
        import ray
    except ImportError as exc:
        raise RayNotInstalledError(
            f"executor 'ray' needs Ray, which cannot be imported ({exc}); install it with "
            f"{INSTALL_HINT}"
        ) from exc
    return ray


@dataclass
class _Connection:
    """How many executors use the connection, and whether vlite opened it."""

    users: int = 0
    opened_by_vlite: bool = False


_CONNECTION = _Connection()
_LOCK = threading.Lock()


def connect(address: str | None) -> None:
    """Connect this process to Ray at ``address`` unless it is connected; count a user.

    ``address=None`` lets Ray choose: ``RAY_ADDRESS``, else a cluster started on this
    machine, else a new local instance.
    """
    ray = import_ray()
    with _LOCK:
        if _CONNECTION.users == 0:
            _CONNECTION.opened_by_vlite = not ray.is_initialized()
            if _CONNECTION.opened_by_vlite:
                ray.init(address=address)
        _CONNECTION.users += 1


def disconnect() -> None:
    """One user fewer; the last one closes a connection vlite opened."""
    ray = import_ray()
    with _LOCK:
        _CONNECTION.users = max(0, _CONNECTION.users - 1)
        if _CONNECTION.users or not _CONNECTION.opened_by_vlite:
            return
        _CONNECTION.opened_by_vlite = False
        if ray.is_initialized():
            ray.shutdown()


def opened_by_vlite() -> bool:
    """Whether vlite opened the current connection (and will close it)."""
    return _CONNECTION.opened_by_vlite
