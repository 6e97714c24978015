"""OpenAI-shaped errors: one exception type, and the handlers that turn errors into JSON."""

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
    """Every error leaves the server as OpenAI-shaped JSON."""

    @app.exception_handler(OpenAIError)
    async def _openai_error(request: Request, exc: OpenAIError) -> JSONResponse:
        return exc.to_json_response()

    @app.exception_handler(RequestValidationError)
    async def _invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc).to_json_response()

    @app.exception_handler(VliteError)
    async def _vlite_error(request: Request, exc: VliteError) -> JSONResponse:
        # vlite's own errors (an invalid request found while preparing it, the engine
        # gone): answered here, not by the catch-all below, which also re-raises.
        return from_exception(exc).to_json_response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        return from_exception(exc).to_json_response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return OpenAIError(str(exc.detail), exc.status_code).to_json_response()
