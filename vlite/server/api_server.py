"""The OpenAI-compatible HTTP server: the FastAPI app, and :class:`ApiServer` that runs it.

Endpoints: ``GET /health``, ``GET /v1/models``, ``GET /metrics`` (Prometheus),
``POST /v1/completions``, ``POST /v1/chat/completions`` (both streaming with
``"stream": true``).
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable
from http import HTTPStatus

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from vlite import __version__
from vlite.core.config import VliteConfig, describe_sources
from vlite.engine.async_llm import AsyncLLM
from vlite.server.errors import OpenAIError, install_error_handlers
from vlite.server.metrics import CONTENT_TYPE as METRICS_TYPE
from vlite.server.metrics import render_metrics
from vlite.server.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from vlite.server.serving_chat import ChatServing
from vlite.server.serving_completions import CompletionServing
from vlite.worker.cpu_threads import default_cpu_threads, physical_cores

logger = logging.getLogger(__name__)

#: The name ``/v1/models`` reports for the default model (``model=None``).
DEFAULT_SERVED_MODEL_NAME = "SmolLM2-135M-Instruct"
#: Seconds open connections get to finish when the server stops; then they are cancelled.
GRACEFUL_SHUTDOWN_S = 5


def served_model_name_for(config: VliteConfig, served_model_name: str | None = None) -> str:
    return served_model_name or config.model or DEFAULT_SERVED_MODEL_NAME


#: ``max_num_batched_tokens`` for serving when nobody set it: small enough on CPU that a
#: prompt chunk does not stall the running requests' next tokens for long.
SERVING_TOKEN_BUDGET = {"cpu": 128, "cuda": 2048}


def with_serving_defaults(
    config: VliteConfig, config_file: str | None = None, overrides: dict | None = None
) -> VliteConfig:
    """``config`` with the server's scheduling and thread defaults where nobody chose
    otherwise.

    Online, a long prompt must not hold up every running stream, so (as vLLM's server)
    ``vlite serve`` chunks prefills with whichever scheduler policy is chosen, under a
    per-device token budget: ``enable_chunked_prefill`` unless it was set (a config file,
    ``VLITE_*`` variable or flag wins), and the budget while it is unset too.
    """
    origins = describe_sources(config_file, overrides or {})
    update: dict = {}
    if origins["cpu_threads"] == "default" and physical_cores() >= 4:
        # The API process tokenizes and streams: leave it a core on machines that have
        # cores to spare (on two, halving the engine's threads costs more than it saves).
        update["cpu_threads"] = default_cpu_threads(config.tensor_parallel_size, 1)
    if origins["enable_chunked_prefill"] == "default":
        update["enable_chunked_prefill"] = True
    chunks = update.get("enable_chunked_prefill", config.enable_chunked_prefill)
    if chunks and origins["max_num_batched_tokens"] == "default":
        update["max_num_batched_tokens"] = SERVING_TOKEN_BUDGET[config.torch_device.type]
    if not update:
        return config
    return VliteConfig(**{**config.model_dump(), **update})


def build_app(engine: AsyncLLM, served_model_name: str) -> FastAPI:
    """The FastAPI app serving ``engine`` under ``served_model_name`` (the engine is not
    owned: whoever built it shuts it down)."""
    app = FastAPI(title="vlite", version=__version__)
    install_error_handlers(app)
    completions = CompletionServing(engine, served_model_name)
    chat = ChatServing(engine, served_model_name)
    app.state.engine = engine

    @app.get("/health")
    async def health() -> Response:
        if engine.dead_error is not None:
            return OpenAIError(
                str(engine.dead_error), HTTPStatus.SERVICE_UNAVAILABLE
            ).to_json_response()
        return Response(status_code=HTTPStatus.OK)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        card = ModelCard(id=served_model_name, max_model_len=engine.max_model_len)
        return JSONResponse(ModelList(data=[card]).model_dump())

    @app.get("/metrics")
    async def metrics() -> Response:
        stats = await engine.get_stats()
        return Response(render_metrics(stats, served_model_name), media_type=METRICS_TYPE)

    @app.post("/v1/completions")
    async def create_completion(request: CompletionRequest, raw_request: Request) -> Response:
        return await completions.create(request, raw_request)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(
        request: ChatCompletionRequest, raw_request: Request
    ) -> Response:
        return await chat.create(request, raw_request)

    return app


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket: bound early, so port 0 picks a free port and a busy port
    fails before the model loads; connections made before serving starts wait in its
    backlog."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    sock.listen(2048)
    sock.set_inheritable(False)
    return sock


class ApiServer:
    """Runs the app on uvicorn with an AsyncLLM it owns, on a socket it is given.

    Args:
        config: the engine configuration.
        sock: a listening socket (see :func:`bind_socket`).
        served_model_name: the model name clients use; default: ``config.model``.
        log_level: uvicorn's log level.
        on_ready: called (in the server's thread) once the engine is ready, with this server.
    """

    def __init__(
        self,
        config: VliteConfig,
        sock: socket.socket,
        *,
        served_model_name: str | None = None,
        log_level: str = "info",
        on_ready: Callable[[ApiServer], None] | None = None,
    ) -> None:
        self.config = config
        self.sock = sock
        self.served_model_name = served_model_name_for(config, served_model_name)
        self.log_level = log_level
        self.on_ready = on_ready
        self.engine: AsyncLLM | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self._server: uvicorn.Server | None = None
        self._stop_requested = False

    @property
    def address(self) -> str:
        host, port = self.sock.getsockname()[:2]
        return f"http://{f'[{host}]' if ':' in host else host}:{port}"

    def run(self) -> None:
        """Serve until :meth:`stop` (or SIGINT/SIGTERM in the main thread)."""
        asyncio.run(self.serve())

    async def serve(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.engine = AsyncLLM.from_config(self.config)
        try:
            app = build_app(self.engine, self.served_model_name)
            uvicorn_config = uvicorn.Config(
                app,
                log_level=self.log_level,
                lifespan="off",
                timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
            )
            self._server = uvicorn.Server(uvicorn_config)
            self._server.should_exit = self._stop_requested
            if self.on_ready is not None:
                self.on_ready(self)
            await self._server.serve(sockets=[self.sock])
        finally:
            self.engine.shutdown()

    def stop(self) -> None:
        """Ask the server to stop (thread-safe); :meth:`run` returns once it has."""
        self._stop_requested = True
        if self.loop is not None and self._server is not None:
            self.loop.call_soon_threadsafe(setattr, self._server, "should_exit", True)
