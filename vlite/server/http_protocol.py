"""uvicorn's h11 protocol with a deadline for request headers, so slow clients are cut, and
a lingering close after early answers.

uvicorn times out idle keep-alive connections, but a client that opens a connection and
sends its request line and headers a byte at a time (or never) holds it open forever. This
protocol gives every request ``header_timeout_s`` seconds from its first byte (or from the
connection's start) to the end of its headers; then the connection is closed. The body is
timed by :class:`~vlite.server.guards.RequestSizeGuard`, and the size of the header block
by h11's ``max_incomplete_event_size``.

It builds on :class:`~vlite.server.lingering_close.LingeringCloseProtocol`: a connection
whose request was refused before its body was read keeps reading (and dropping) for a
bounded time after the answer, so the client reads the whole refusal instead of a reset.
"""

from __future__ import annotations

import asyncio

import h11

from vlite.server.lingering_close import LingeringCloseProtocol


class HeaderTimeoutProtocol(LingeringCloseProtocol):
    """:class:`LingeringCloseProtocol` that closes a connection whose request headers are
    late."""

    #: Set by :func:`protocol_with_header_timeout`.
    header_timeout_s = 10.0

    _header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_timer()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is h11.IDLE:  # a request started but its headers are not in
            self._arm_header_timer()
        else:
            self._disarm_header_timer()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        # The keep-alive timer covers the idle time; the next request's first byte re-arms.
        self._disarm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_timer()
        super().connection_lost(exc)

    def _arm_header_timer(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_late)

    def _disarm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_late(self) -> None:
        self._header_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.logger.info("closing a connection whose request headers took too long")
            self.transport.close()


def protocol_with_header_timeout(header_timeout_s: float) -> type[HeaderTimeoutProtocol]:
    """A :class:`HeaderTimeoutProtocol` class with this deadline (uvicorn's ``http=``)."""
    return type(
        "HeaderTimeoutProtocol",
        (HeaderTimeoutProtocol,),
        {"header_timeout_s": header_timeout_s, "__module__": __name__},
    )
