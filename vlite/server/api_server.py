"""The OpenAI-compatible HTTP server: the FastAPI app, and :class:`ApiServer` that runs it.

Endpoints: ``GET /health``, ``GET /v1/models``, ``GET /metrics`` (Prometheus),
``POST /v1/completions``, ``POST /v1/chat/completions`` (both streaming with
``"stream": true``, both with llama.cpp's ``timings``), Anthropic's ``POST /v1/messages``,
OpenAI's ``POST /v1/responses`` (stateless), and vLLM's ``POST /tokenize`` and
``POST /detokenize``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import threading
from collections.abc import Callable
from http import HTTPStatus

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from vlite import __version__
from vlite.core.config import VliteConfig, describe_sources
from vlite.engine.async_llm import AsyncLLM
from vlite.engine.exceptions import EngineDeadError
from vlite.server.errors import OpenAIError, install_error_handlers
from vlite.server.guards import ApiKeyGuard, ASGIApp, Drain, DrainGuard, RequestSizeGuard
from vlite.server.http_protocol import protocol_with_header_timeout
from vlite.server.metrics import CONTENT_TYPE as METRICS_TYPE
from vlite.server.metrics import RequestHistograms, render_metrics
from vlite.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
)
from vlite.server.serving_chat import ChatServing
from vlite.server.serving_completions import CompletionServing
from vlite.server.serving_messages import MessagesServing
from vlite.server.serving_responses import ResponsesServing
from vlite.server.serving_tokenize import TokenizeServing
from vlite.server.settings import ServerSettings
from vlite.server.tool_calls import with_template_tool_parser
from vlite.worker.cpu_threads import default_cpu_threads, physical_cores

logger = logging.getLogger(__name__)

#: The name ``/v1/models`` reports for the default model (``model=None``).
DEFAULT_SERVED_MODEL_NAME = "SmolLM2-135M-Instruct"
#: Seconds open connections get to finish when the server stops; then they are cancelled.
GRACEFUL_SHUTDOWN_S = 5
#: How often the server checks that its engine core is alive.
ENGINE_WATCH_INTERVAL_S = 0.2


def served_model_name_for(config: VliteConfig, served_model_name: str | None = None) -> str:
    return served_model_name or config.model or DEFAULT_SERVED_MODEL_NAME


#: ``max_num_batched_tokens`` for serving when nobody set it: small enough on CPU that a
#: prompt chunk does not stall the running requests' next tokens for long.
SERVING_TOKEN_BUDGET = {"cpu": 128, "cuda": 2048}


def with_serving_defaults(
    config: VliteConfig,
    config_file: str | None = None,
    overrides: dict | None = None,
    data_parallel_size: int = 1,
) -> VliteConfig:
    """``config`` with the server's scheduling and thread defaults where nobody chose
    otherwise.

    Online, a long prompt must not hold up every running stream, so (as vLLM's server)
    ``vlite serve`` chunks prefills with whichever scheduler policy is chosen, under a
    per-device token budget: ``enable_chunked_prefill`` unless it was set (a config file,
    ``VLITE_*`` variable or flag wins), and the budget while it is unset too.

    The CPU threads, unless set, are the physical cores split over every worker of the
    ``data_parallel_size`` engine cores, less one core for the API process where there
    are at least four.
    """
    origins = describe_sources(config_file, overrides or {})
    update: dict = {}
    cores = physical_cores()
    if origins["cpu_threads"] == "default" and (cores >= 4 or data_parallel_size > 1):
        # The API process tokenizes and streams: leave it a core on machines that have
        # cores to spare (on two, halving the engine's threads costs more than it saves).
        num_workers = (
            config.tensor_parallel_size * config.pipeline_parallel_size * data_parallel_size
        )
        update["cpu_threads"] = default_cpu_threads(num_workers, 1 if cores >= 4 else 0)
    if origins["enable_chunked_prefill"] == "default":
        update["enable_chunked_prefill"] = True
    chunks = update.get("enable_chunked_prefill", config.enable_chunked_prefill)
    if chunks and origins["max_num_batched_tokens"] == "default":
        update["max_num_batched_tokens"] = SERVING_TOKEN_BUDGET[config.torch_device.type]
    if not update:
        return config
    return VliteConfig(**{**config.model_dump(), **update})


def build_app(
    engine: AsyncLLM,
    served_model_name: str,
    settings: ServerSettings | None = None,
    drain: Drain | None = None,
) -> ASGIApp:
    """The ASGI app serving ``engine`` under ``served_model_name``: the routes behind the
    guards (API key, request sizes, drain). The engine is not owned: whoever built it shuts
    it down.

    Args:
        settings: the server's limits and keys; default: ``ServerSettings()`` (no key).
        drain: the drain state the server sets on shutdown; default: a fresh one.
    """
    settings = settings or ServerSettings()
    app = FastAPI(title="vlite", version=__version__)
    install_error_handlers(app)
    completions = CompletionServing(engine, served_model_name, settings)
    chat = ChatServing(engine, served_model_name, settings)
    messages = MessagesServing(engine, served_model_name, settings)
    responses = ResponsesServing(engine, served_model_name, settings)
    tokenization = TokenizeServing(engine, served_model_name, settings)
    app.state.engine = engine

    @app.get("/health")
    async def health() -> Response:
        # With several engine cores, dead_error names the core that died.
        if engine.dead_error is not None:
            return OpenAIError(
                str(engine.dead_error), HTTPStatus.SERVICE_UNAVAILABLE
            ).to_json_response()
        return Response(status_code=HTTPStatus.OK)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        card = ModelCard(id=served_model_name, max_model_len=engine.max_model_len)
        return JSONResponse(ModelList(data=[card]).model_dump())

    histograms = RequestHistograms(served_model_name, engine.max_model_len)
    engine.add_finished_request_observer(histograms.observe)

    @app.get("/metrics")
    async def metrics() -> Response:
        per_engine = await engine.get_engine_stats()  # None for a dead core
        text = render_metrics(per_engine, served_model_name, histograms)
        return Response(text, media_type=METRICS_TYPE)

    @app.post("/v1/completions")
    async def create_completion(request: CompletionRequest, raw_request: Request) -> Response:
        return await completions.create(request, raw_request)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(
        request: ChatCompletionRequest, raw_request: Request
    ) -> Response:
        return await chat.create(request, raw_request)

    @app.post("/v1/messages")
    async def create_message(raw_request: Request) -> Response:
        # The body is parsed by the endpoint: its errors are Anthropic-shaped.
        return await messages.create(raw_request)

    @app.post("/v1/responses")
    async def create_response(raw_request: Request) -> Response:
        # The body is parsed by the endpoint: its complaints name the field.
        return await responses.create(raw_request)

    @app.post("/tokenize")
    async def tokenize(request: TokenizeRequest) -> JSONResponse:
        return JSONResponse((await tokenization.tokenize(request)).model_dump())

    @app.post("/detokenize")
    async def detokenize(request: DetokenizeRequest) -> JSONResponse:
        return JSONResponse((await tokenization.detokenize(request)).model_dump())

    guarded: ASGIApp = DrainGuard(app, drain or Drain())
    guarded = RequestSizeGuard(
        guarded,
        max_headers=settings.max_headers,
        max_header_bytes=settings.max_header_bytes,
        max_body_bytes=settings.max_request_bytes,
        body_timeout_s=settings.body_timeout_s,
    )
    if settings.api_key:
        guarded = ApiKeyGuard(guarded, settings.api_key, settings.protect_metrics)
    return guarded


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


class _Server(uvicorn.Server):
    """uvicorn's server without its signal handling: :class:`ApiServer` drains first."""

    def capture_signals(self):  # type: ignore[override]
        return contextlib.nullcontext()


class ApiServer:
    """Runs the app on uvicorn with an AsyncLLM it owns, on a socket it is given.

    Shutdown: the first SIGTERM or SIGINT (in the main thread) starts a drain: new requests
    get 503 with ``Retry-After``, running ones get ``settings.shutdown_timeout_s`` seconds
    to finish, then each remaining stream ends with an error event and ``[DONE]`` (a
    non-streamed request gets a 503), the engine-core process and its workers stop and the
    IPC files go; :meth:`run` then returns. A second signal skips the wait. If the engine
    core dies, in-flight requests fail at once and the server stops too, with
    :attr:`exit_code` 1, so that a supervisor restarts it. With several engine cores
    (``settings.data_parallel_size``) the same happens when any one of them dies: its
    requests and those of the others fail at once, and every core is stopped.

    Args:
        config: the engine configuration.
        sock: a listening socket (see :func:`bind_socket`).
        settings: the server's settings (``served_model_name``, ``log_level``, keys,
            limits, timeouts); default: ``ServerSettings()``. Once the engine has started,
            :attr:`settings` names the tool-call parser chosen from the model's chat
            template when none was named (see
            :func:`~vlite.server.tool_calls.with_template_tool_parser`).
        on_ready: called (in the server's thread) once the engine is ready, with this server.
    """

    def __init__(
        self,
        config: VliteConfig,
        sock: socket.socket,
        settings: ServerSettings | None = None,
        *,
        on_ready: Callable[[ApiServer], None] | None = None,
    ) -> None:
        self.config = config
        self.sock = sock
        self.settings = settings or ServerSettings()
        self.served_model_name = served_model_name_for(config, self.settings.served_model_name)
        self.on_ready = on_ready
        self.engine: AsyncLLM | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.drain = Drain()
        #: 0 after a requested stop, 1 when the server stopped because the engine died.
        self.exit_code = 0
        self._server: uvicorn.Server | None = None
        self._stop_requested = False
        self._shutdown_task: asyncio.Task | None = None

    @property
    def address(self) -> str:
        host, port = self.sock.getsockname()[:2]
        return f"http://{f'[{host}]' if ':' in host else host}:{port}"

    def run(self) -> None:
        """Serve until :meth:`stop`, a signal, or the engine's death."""
        asyncio.run(self.serve())

    async def serve(self) -> None:
        self.loop = asyncio.get_running_loop()
        settings = self.settings
        self.engine = AsyncLLM.from_config(
            self.config,
            data_parallel_size=settings.data_parallel_size,
            data_parallel_backend=settings.data_parallel_backend,
            data_parallel_resources=settings.data_parallel_resources,
        )
        watcher = None
        try:
            self.settings = with_template_tool_parser(settings, self.engine.get_tokenizer())
            app = build_app(self.engine, self.served_model_name, self.settings, self.drain)
            self._server = _Server(self._uvicorn_config(app))
            self._server.should_exit = self._stop_requested
            self._install_signal_handlers()
            watcher = self.loop.create_task(self._watch_engine(), name="vlite-engine-watch")
            if self.on_ready is not None:
                self.on_ready(self)
            await self._server.serve(sockets=[self.sock])
        finally:
            if watcher is not None:
                watcher.cancel()
            self._remove_signal_handlers()
            self.engine.shutdown()

    def _uvicorn_config(self, app: ASGIApp) -> uvicorn.Config:
        settings = self.settings
        return uvicorn.Config(
            app,
            log_level=settings.log_level,
            lifespan="off",
            http=protocol_with_header_timeout(settings.header_timeout_s),
            h11_max_incomplete_event_size=settings.max_header_bytes,
            timeout_keep_alive=int(max(1, settings.keep_alive_timeout_s)),
            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        )

    def stop(self) -> None:
        """Stop now (thread-safe): open connections get a few seconds; :meth:`run` returns
        once the server has stopped."""
        self._stop_requested = True
        if self.loop is not None and self._server is not None:
            self.loop.call_soon_threadsafe(setattr, self._server, "should_exit", True)

    def shut_down_gracefully(self) -> None:
        """Drain, then stop (see the class docstring); call it on the server's loop. A
        second call stops at once."""
        if self._shutdown_task is not None:
            logger.warning("second shutdown request: stopping now")
            self._end_in_flight("the server is shutting down")
            self._server.should_exit = True
            self._server.force_exit = True
            return
        self._shutdown_task = self.loop.create_task(self._drain_and_stop())

    async def _drain_and_stop(self) -> None:
        timeout_s = self.settings.shutdown_timeout_s
        logger.info("shutting down: refusing new requests, %g s for running ones", timeout_s)
        self.drain.draining = True
        if not await self.drain.wait_idle(timeout_s):
            logger.warning(
                "%d requests still running after %g s: ending them",
                self.drain.num_in_flight,
                timeout_s,
            )
            self._end_in_flight(f"the server shut down after waiting {timeout_s:g} s")
            await self.drain.wait_idle(GRACEFUL_SHUTDOWN_S)
        self._server.should_exit = True

    def _end_in_flight(self, reason: str) -> None:
        if self.engine is not None and self.engine.dead_error is None:
            self.engine.fail_all(EngineDeadError(reason))

    async def _watch_engine(self) -> None:
        """Stop the server, with exit code 1, once the engine core is dead."""
        while self.engine.dead_error is None:
            await asyncio.sleep(ENGINE_WATCH_INTERVAL_S)
        logger.error("the engine core died (%s): stopping the server", self.engine.dead_error)
        self.exit_code = 1
        self.engine.fail_all(self.engine.dead_error)
        self.drain.reason = str(self.engine.dead_error)  # /health keeps naming the dead core
        self.drain.draining = True
        await self.drain.wait_idle(GRACEFUL_SHUTDOWN_S)
        self._server.should_exit = True

    def _install_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        for sig in (signal.SIGTERM, signal.SIGINT):
            self.loop.add_signal_handler(sig, self.shut_down_gracefully)

    def _remove_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread() or self.loop is None:
            return
        for sig in (signal.SIGTERM, signal.SIGINT):
            self.loop.remove_signal_handler(sig)
