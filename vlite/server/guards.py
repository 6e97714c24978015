"""ASGI middleware at the HTTP boundary: checks that run before a request reaches a route.

Each guard is a plain ASGI wrapper (no request object is built for a request it refuses),
answers in the error shape of the request's path (OpenAI's; Anthropic's on
``/v1/messages``, see :func:`vlite.server.errors.error_response`) with ``Connection:
close`` (the refused request's body, if any, is left unread; the protocol's lingering
close lets the client read the answer whole, see :mod:`vlite.server.lingering_close`),
and passes everything else through untouched:

- :class:`ApiKeyGuard`: ``Authorization: Bearer <key>`` (OpenAI's clients) or
  ``x-api-key: <key>`` (Anthropic's) on every route but the open ones (401), compared in
  constant time.
- :class:`RequestSizeGuard`: too many or too large header fields (431; uvicorn's h11
  limit alone lets a header block through when it arrives in one piece), a body larger
  than the limit (413, before it is read when ``Content-Length`` says so), a client that
  stalls while sending its body (408).
- :class:`DrainGuard`: while the server drains for shutdown (:class:`Drain`), new requests
  get 503 with ``Retry-After``; it counts the requests in flight so the drain knows when
  they are done.
"""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import Awaitable, Callable, MutableMapping
from http import HTTPStatus
from typing import Any

from vlite.server.errors import OpenAIError, error_response

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

#: Paths that answer without an API key (``/metrics`` unless ``protect_metrics``).
OPEN_PATHS = frozenset({"/health"})


async def _refuse(error: OpenAIError, scope: Scope, receive: Receive, send: Send, **headers):
    """Answer ``error`` (in its path's shape) with ``Connection: close``: a refusal may
    leave the request's body unread, so the connection ends (lingering until the client
    has read the answer, see :mod:`vlite.server.lingering_close`) rather than reading that
    body to be reused."""
    response = error_response(error, scope["path"], {**headers, "Connection": "close"})
    await response(scope, receive, send)


class ApiKeyGuard:
    """Require one of ``keys`` as a bearer token or an ``x-api-key`` header, except on
    :data:`OPEN_PATHS`."""

    def __init__(self, app: ASGIApp, keys: tuple[str, ...], protect_metrics: bool) -> None:
        self.app = app
        self.keys = [key.encode() for key in keys]
        self.open_paths = OPEN_PATHS if protect_metrics else OPEN_PATHS | {"/metrics"}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.open_paths or self.is_allowed(scope):
            await self.app(scope, receive, send)
            return
        error = OpenAIError(
            "a valid API key is required: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'",
            HTTPStatus.UNAUTHORIZED,
        )
        await _refuse(error, scope, receive, send, **{"WWW-Authenticate": "Bearer"})

    def is_allowed(self, scope: Scope) -> bool:
        token = b""
        for name, value in scope["headers"]:
            if name == b"authorization" and value[:7].lower() == b"bearer ":
                token = value[7:].strip()
            elif name == b"x-api-key":
                token = value.strip()
        # Compare with every key, whatever matched: the time taken says nothing of which.
        matched = False
        for key in self.keys:
            matched |= hmac.compare_digest(token, key)
        return matched


class _BodyError(BaseException):
    """Raised from ``receive`` and caught by :class:`RequestSizeGuard`. A BaseException,
    because the framework turns any Exception while reading a body into its own 400."""


class _BodyTooLarge(_BodyError):
    pass


class _BodyStalled(_BodyError):
    pass


class RequestSizeGuard:
    """Limit the header count, the body size and the pauses while a body is sent."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        max_headers: int,
        max_header_bytes: int,
        max_body_bytes: int,
        body_timeout_s: float,
    ) -> None:
        self.app = app
        self.max_headers = max_headers
        self.max_header_bytes = max_header_bytes
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        problem = self._header_problem(scope["headers"])
        if problem is not None:
            error = OpenAIError(problem, HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE)
            await _refuse(error, scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_body_bytes:
            await _refuse(self._too_large(declared), scope, receive, send)
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, self._limited(receive), tracking_send)
        except _BodyError as exc:
            if started:
                raise
            error = (
                self._too_large(None)
                if isinstance(exc, _BodyTooLarge)
                else OpenAIError(
                    f"the request body stalled for more than {self.body_timeout_s:g} s",
                    HTTPStatus.REQUEST_TIMEOUT,
                )
            )
            await _refuse(error, scope, receive, send)

    def _header_problem(self, headers: list[tuple[bytes, bytes]]) -> str | None:
        if len(headers) > self.max_headers:
            return f"the request has {len(headers)} header fields; at most {self.max_headers}"
        size = sum(len(name) + len(value) for name, value in headers)
        if size > self.max_header_bytes:
            return f"the request's headers take {size} bytes; at most {self.max_header_bytes}"
        return None

    def _limited(self, receive: Receive) -> Receive:
        """``receive`` that counts body bytes and times out pauses until the body ends."""
        received = 0
        body_done = False

        async def limited_receive() -> Message:
            nonlocal received, body_done
            if body_done:  # waiting for a disconnect, not for the body
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), self.body_timeout_s)
            except asyncio.TimeoutError:
                raise _BodyStalled() from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    raise _BodyTooLarge()
                body_done = not message.get("more_body", False)
            return message

        return limited_receive

    def _too_large(self, size: int | None) -> OpenAIError:
        what = f"of {size} bytes " if size is not None else ""
        return OpenAIError(
            f"the request body {what}is larger than the limit of {self.max_body_bytes} bytes",
            HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
        )


def _content_length(scope: Scope) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


class Drain:
    """The server's drain state: whether it refuses new requests, and how many are in
    flight (counted by :class:`DrainGuard`)."""

    def __init__(self) -> None:
        self.draining = False
        #: Why it drains, when not asked to (the refusals say it): an engine core's death.
        self.reason: str | None = None
        self.num_in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def enter(self) -> None:
        self.num_in_flight += 1
        self._idle.clear()

    def leave(self) -> None:
        self.num_in_flight -= 1
        if not self.num_in_flight:
            self._idle.set()

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no request is in flight; ``False`` if ``timeout_s`` passed first."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except asyncio.TimeoutError:
            return False
        return True


class DrainGuard:
    """Count requests in flight; while ``drain.draining``, refuse new ones with 503 and
    ``Retry-After`` (``/health`` too, so load balancers move away)."""

    def __init__(self, app: ASGIApp, drain: Drain, retry_after_s: int = 5) -> None:
        self.app = app
        self.drain = drain
        self.retry_after_s = retry_after_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.drain.draining:
            reason = f" ({self.drain.reason})" if self.drain.reason else ""
            error = OpenAIError(
                f"the server is shutting down{reason}; retry on another instance or later",
                HTTPStatus.SERVICE_UNAVAILABLE,
            )
            await _refuse(error, scope, receive, send, **{"Retry-After": str(self.retry_after_s)})
            return
        self.drain.enter()
        try:
            await self.app(scope, receive, send)
        finally:
            self.drain.leave()
