"""Errors: one exception type, the handlers that turn errors into JSON, and the shape that
JSON takes.

Every refusal is OpenAI's ``{"error": {...}}``, except on Anthropic's Messages API
(``/v1/messages`` and anything under it), whose clients read Anthropic's ``{"type":
"error", "error": {"type", "message"}}``: :func:`error_response` picks the shape from the
request's path, for the app's handlers, the ASGI guards (:mod:`vlite.server.guards`) and
the endpoints alike.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Mapping
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from vlite.core.errors import InvalidRequestError, VliteError
from vlite.core.sampling_params import SamplingParamsError
from vlite.core.structured_output_params import StructuredOutputsError
from vlite.engine.exceptions import EngineDeadError, EngineGenerateError
from vlite.server.anthropic_protocol import AnthropicErrorInfo, AnthropicErrorResponse
from vlite.server.protocol import ErrorInfo, ErrorResponse

logger = logging.getLogger(__name__)

#: Longest error message sent (an error body stays under 2 KB).
MAX_MESSAGE_CHARS = 1000


class OpenAIError(Exception):
    """An error to send as ``{"error": {...}}`` with an HTTP status.

    Args:
        message: what is wrong and, for bad input, what is allowed.
        status: the HTTP status (400 for bad input).
        param: the request field at fault, if one is.
    """

    def __init__(
        self, message: str, status: int = HTTPStatus.BAD_REQUEST, param: str | None = None
    ) -> None:
        if len(message) > MAX_MESSAGE_CHARS:  # never echo much of a request back
            message = message[:MAX_MESSAGE_CHARS] + f"... ({len(message)} characters)"
        super().__init__(message)
        self.message = message
        self.status = int(status)
        self.param = param

    @property
    def type(self) -> str:
        if self.status == HTTPStatus.NOT_FOUND:
            return "NotFoundError"
        if self.status == HTTPStatus.UNAUTHORIZED:
            return "AuthenticationError"
        if self.status < 500:
            return "BadRequestError"
        return "InternalServerError"

    def to_response(self) -> ErrorResponse:
        info = ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.status)
        return ErrorResponse(error=info)

    def to_json_response(self) -> JSONResponse:
        return JSONResponse(self.to_response().model_dump(), status_code=self.status)


#: The path of Anthropic's Messages API: refusals there and under it take Anthropic's shape.
ANTHROPIC_PATH = "/v1/messages"

#: Anthropic's error ``type`` for each HTTP status it names (others: by class, see
#: :func:`anthropic_error`). Its overloaded server is ``overloaded_error`` (529 in its API;
#: vlite's draining or dead server answers 503).
ANTHROPIC_ERROR_TYPES = {
    HTTPStatus.BAD_REQUEST: "invalid_request_error",
    HTTPStatus.UNAUTHORIZED: "authentication_error",
    HTTPStatus.FORBIDDEN: "permission_error",
    HTTPStatus.NOT_FOUND: "not_found_error",
    HTTPStatus.REQUEST_ENTITY_TOO_LARGE: "request_too_large",
    HTTPStatus.TOO_MANY_REQUESTS: "rate_limit_error",
    HTTPStatus.SERVICE_UNAVAILABLE: "overloaded_error",
}


def anthropic_error(error: OpenAIError) -> AnthropicErrorResponse:
    """``error`` in Anthropic's shape (same status and message): a status Anthropic does
    not name is ``invalid_request_error`` below 500 (408, 431, 405...), ``api_error``
    from 500."""
    kind = ANTHROPIC_ERROR_TYPES.get(
        error.status, "invalid_request_error" if error.status < 500 else "api_error"
    )
    return AnthropicErrorResponse(error=AnthropicErrorInfo(type=kind, message=error.message))


def speaks_anthropic(path: str) -> bool:
    """Whether a request to ``path`` comes from Anthropic's clients (:data:`ANTHROPIC_PATH`
    or a path under it)."""
    return path == ANTHROPIC_PATH or path.startswith(ANTHROPIC_PATH + "/")


def error_response(
    error: OpenAIError, path: str, headers: Mapping[str, str] | None = None
) -> JSONResponse:
    """``error`` as the JSON response the client of ``path`` reads: Anthropic's shape on
    its Messages API (:func:`speaks_anthropic`), OpenAI's everywhere else; same status,
    and ``headers`` added."""
    if speaks_anthropic(path):
        body = anthropic_error(error).model_dump()
        response = JSONResponse(body, status_code=error.status)
    else:
        response = error.to_json_response()
    response.headers.update(headers or {})
    return response


def shorten(value: object, limit: int = 80) -> str:
    """``repr(value)``, cut to ``limit`` characters: error messages never echo much input."""
    text = repr(value)
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text)} characters)"


def from_exception(exc: BaseException) -> OpenAIError:
    """The OpenAIError for an error raised while serving a request.

    Only an :class:`~vlite.core.errors.InvalidRequestError` (and the request body's own
    validation, see :func:`install_error_handlers`) is the client's fault: 400. Anything
    else is the server's: 500 (503 when the engine is gone), and an unexpected exception is
    logged with its traceback under an id the response names, never shown as bad input.
    """
    if isinstance(exc, OpenAIError):
        return exc
    if isinstance(exc, (SamplingParamsError, StructuredOutputsError)):
        return OpenAIError(str(exc).removeprefix("SamplingParams."), param=exc.param)
    if isinstance(exc, InvalidRequestError):
        return OpenAIError(str(exc))
    if isinstance(exc, EngineDeadError):
        return OpenAIError(str(exc), HTTPStatus.SERVICE_UNAVAILABLE)
    if isinstance(exc, EngineGenerateError):
        return OpenAIError(str(exc), HTTPStatus.INTERNAL_SERVER_ERROR)
    error_id = uuid.uuid4().hex[:12]
    logger.error("internal error %s while serving a request", error_id, exc_info=exc)
    return OpenAIError(
        f"internal server error (id {error_id}; the server's log has the details)",
        HTTPStatus.INTERNAL_SERVER_ERROR,
    )


def validation_error(exc: RequestValidationError) -> OpenAIError:
    """Pydantic's first complaint, as ``field: message``, naming the field as ``param``
    (a body FastAPI validated)."""
    errors = exc.errors()
    if not errors:
        return OpenAIError("invalid request body")
    return complaint_error(errors[0])


def complaint_error(complaint: Mapping[str, Any]) -> OpenAIError:
    """One of pydantic's complaints as a 400 naming its field."""
    location = [str(part) for part in complaint.get("loc", ()) if part != "body"]
    param = ".".join(location) or None
    message = complaint.get("msg", "invalid value")
    if param is None:
        return OpenAIError(f"invalid request body: {message}")
    if complaint.get("type") == "missing":
        return OpenAIError(f"{param} is required", param=param)
    return OpenAIError(
        f"{param}={shorten(complaint.get('input'))} is invalid: {message}", param=param
    )


def install_error_handlers(app: FastAPI) -> None:
    """Every error leaves the server as JSON in the shape its path's clients read (see
    :func:`error_response`)."""

    @app.exception_handler(OpenAIError)
    async def _openai_error(request: Request, exc: OpenAIError) -> JSONResponse:
        return error_response(exc, request.scope["path"])

    @app.exception_handler(RequestValidationError)
    async def _invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(validation_error(exc), request.scope["path"])

    @app.exception_handler(VliteError)
    async def _vlite_error(request: Request, exc: VliteError) -> JSONResponse:
        # vlite's own errors (an invalid request found while preparing it, the engine
        # gone): answered here, not by the catch-all below, which also re-raises.
        return error_response(from_exception(exc), request.scope["path"])

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        return error_response(from_exception(exc), request.scope["path"])

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # Routing's 404 and 405 (the latter with its Allow header).
        error = OpenAIError(str(exc.detail), exc.status_code)
        return error_response(error, request.scope["path"], exc.headers)
