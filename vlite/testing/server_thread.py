"""A real ``vlite serve`` for tests: the API server on uvicorn in a thread of this process,
its engine core in a process of its own, on a free local port."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from vlite.core.config import VliteConfig
from vlite.server.api_server import ApiServer, bind_socket
from vlite.server.settings import ServerSettings


@contextlib.contextmanager
def running_server(
    config: VliteConfig, settings: ServerSettings, timeout_s: float = 60
) -> Iterator[ApiServer]:
    """The started server (``.address`` is its URL); stopped, and checked stopped, on exit.

    Raises:
        AssertionError: it did not start within ``2 * timeout_s`` or stop within
            ``timeout_s``.
    """
    ready = threading.Event()
    server = ApiServer(
        config, bind_socket("127.0.0.1", 0), settings, on_ready=lambda _: ready.set()
    )
    thread = threading.Thread(target=server.run, name="test-api-server", daemon=True)
    thread.start()
    assert ready.wait(timeout_s * 2), "the server did not start"
    try:
        yield server
    finally:
        server.stop()
        thread.join(timeout_s)
        assert not thread.is_alive(), "the server did not stop"
        server.sock.close()
