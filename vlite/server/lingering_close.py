"""Lingering close: a connection whose request was answered before its body was read closes
only after the client has had the time to read the answer.

A guard refuses a request (401, 408, 413, 431) before reading all of its body, and the
refusal says ``Connection: close``. Closing the socket then, with the client still sending, makes
the kernel answer the unread bytes with a reset, and a reset can destroy the answer before
the client reads it: the client sees "connection reset" instead of the 413. So, as nginx's
lingering close does, the server instead shuts down its side for writing once the answer
is flushed (the client reads the whole answer and then the end of the stream), keeps
reading and dropping whatever the client still sends, and closes when the client closes
its side, or after :data:`LINGER_TIMEOUT_S`, or after :data:`LINGER_MAX_BYTES` dropped
bytes, whichever comes first. A client that sends its whole body before it reads (most
simple clients do) can finish sending and then read the refusal.

The same applies to any response that completes while its request's body is still
arriving: uvicorn would read such a body to its end, however long, to reuse the
connection; here the connection is not reused but lingers as above and closes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

#: Longest time, in seconds, a connection keeps reading and dropping the body of a
#: request it has answered: time for a client on a slow link to finish sending some
#: megabytes and read the answer; then the connection is cut, even if that resets it.
LINGER_TIMEOUT_S = 5.0
#: Most bytes dropped while lingering (eight times the default request-size limit); a
#: client sending more is cut at once, even if that resets the connection.
LINGER_MAX_BYTES = 64 << 20


class LingeringTransport:
    """A connection's transport whose :meth:`close` lingers while the answered request's
    body is still arriving; everything else is the wrapped transport's.

    A wrapper, not a protocol hook: uvicorn closes the transport itself, in the middle of
    sending the response's last bytes, so the close is where the linger must start.
    """

    def __init__(
        self,
        transport: asyncio.Transport,
        loop: asyncio.AbstractEventLoop,
        body_unread: Callable[[], bool],
    ) -> None:
        self._transport = transport
        self._loop = loop
        self._body_unread = body_unread
        self._deadline: asyncio.TimerHandle | None = None
        self._num_dropped = 0
        #: Whether the answer is sent and the connection only drops what still arrives.
        self.lingering = False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)

    def close(self) -> None:
        """Linger if the answered request's body is still arriving; otherwise close. A
        close while lingering (the server shutting down) closes at once."""
        if self.lingering or self._transport.is_closing() or not self._body_unread():
            self.stop_lingering()
            self._transport.close()
            return
        self._linger()

    def is_closing(self) -> bool:
        """True while lingering too: nothing may be sent, and no timer may reuse or cut
        the connection but the linger's own."""
        return self.lingering or self._transport.is_closing()

    def drop(self, data: bytes) -> None:
        """Count bytes that arrived while lingering; cut the connection past the cap."""
        self._num_dropped += len(data)
        if self._num_dropped > LINGER_MAX_BYTES:
            self._cut()

    def stop_lingering(self) -> None:
        """Cancel the deadline (the connection is closed or closing)."""
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _linger(self) -> None:
        self.lingering = True
        if self._transport.can_write_eof():  # not over TLS: there the deadline ends it
            self._transport.write_eof()  # sent after the buffered answer
        self._transport.resume_reading()  # uvicorn may have paused it for a full buffer
        self._deadline = self._loop.call_later(LINGER_TIMEOUT_S, self._cut)

    def _cut(self) -> None:
        """Close now, dropping any unsent bytes: a client that neither stops sending nor
        reads must not hold the connection."""
        self.stop_lingering()
        self._transport.abort()


class LingeringCloseProtocol(H11Protocol):
    """:class:`H11Protocol` whose connections linger (see the module docstring) instead
    of closing, or being kept alive, while an answered request's body still arrives."""

    transport: LingeringTransport  # type: ignore[assignment]

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        lingering = LingeringTransport(transport, self.loop, self._answered_with_body_unread)
        super().connection_made(lingering)  # type: ignore[arg-type]

    def data_received(self, data: bytes) -> None:
        if self.transport.lingering:
            self.transport.drop(data)  # neither parsed nor buffered: the request is answered
            return
        super().data_received(data)

    def on_response_complete(self) -> None:
        if self._answered_with_body_unread() and not self.transport.is_closing():
            # Answered without 'Connection: close': uvicorn would read the rest of the
            # body, however long, to reuse the connection; it lingers and closes instead.
            self.conn.send(h11.ConnectionClosed())
            self.transport.close()
        super().on_response_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport.stop_lingering()
        super().connection_lost(exc)

    def _answered_with_body_unread(self) -> bool:
        """Whether the current request's response is complete but its body is not."""
        return (
            self.cycle is not None
            and self.cycle.response_complete
            and self.conn.their_state is h11.SEND_BODY
        )
