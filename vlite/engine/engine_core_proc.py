"""EngineCoreProc: an EngineCore in its own process, fed and drained over ZMQ.

Three threads keep the heartbeat free of I/O (vLLM V1's design)::

    input thread  : ZMQ PULL socket -> decode -> input_queue
    main thread   : the busy loop: drain input_queue, step() while there is work, and
                    block on input_queue (no spinning) while there is none
    output thread : output_queue -> encode -> ZMQ PUSH socket

Each sender connects and each receiver binds, so a send never blocks for want of a peer.
The process is started by :class:`~vlite.engine.core_client.CoreProcess` with
:func:`run_engine_core` as its target (multiprocessing "spawn").
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import multiprocessing.connection
import os
import queue
import shutil
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import zmq

from vlite.core.config import VliteConfig
from vlite.core.engine_core import EngineCore
from vlite.core.errors import ExecutorFailedError, InvalidRequestError
from vlite.engine.core_messages import (
    AddRequest,
    CoreInput,
    CoreOutput,
    EngineCoreInfo,
    EngineCoreStats,
    FatalError,
    FinishRequests,
    GetStats,
    Ready,
    RequestErrors,
    Shutdown,
    StartupFailed,
    StepOutputs,
    UtilityResult,
    encoder,
    input_decoder,
)
from vlite.engine.startup_heap import freeze_startup_heap
from vlite.models.spec import ModelSpec

#: The name prefix of the temporary directory holding a front end's IPC sockets.
IPC_DIR_PREFIX = "vlite-ipc-"
#: The environment variable that gives a process its GPUs.
VISIBLE_DEVICES_VARIABLE = "CUDA_VISIBLE_DEVICES"
logger = logging.getLogger(__name__)

#: Builds the EngineCore in the child from the config and the resolved model; must be
#: picklable (a class or module-level function). Default: ``EngineCore`` itself.
EngineCoreFactory = Callable[[VliteConfig, ModelSpec], EngineCore]

# How long the output thread may take to flush its last messages at shutdown.
_OUTPUT_LINGER_MS = 2000


class _Stop:
    """Put on the input queue to end the busy loop (parent gone, or a signal)."""

    def __init__(self, reason: str) -> None:
        self.reason = reason


class EngineCoreProc:
    """Runs ``engine_core`` on requests arriving at ``input_address``.

    Args:
        engine_core: the core to drive (built in this process).
        input_address: ZMQ address this process binds to receive :data:`CoreInput`
            (``tcp://HOST:*`` binds a free port; :attr:`input_address` then names it).
        output_address: ZMQ address of the front end's output socket (connected to).
        node: where this process runs, as :class:`EngineCoreInfo` reports it.
    """

    def __init__(
        self,
        engine_core: EngineCore,
        input_address: str,
        output_address: str,
        node: str = "local",
    ) -> None:
        self.engine_core = engine_core
        self.node = node
        self.input_queue: queue.Queue[CoreInput | _Stop] = queue.Queue()
        self.output_queue: queue.Queue[CoreOutput | None] = queue.Queue()
        self.num_failed_steps = 0
        self._is_running = True
        self._handlers: dict[type, Callable[[Any], None]] = {
            AddRequest: self._add_request,
            FinishRequests: self._finish_requests,
            GetStats: self._get_stats,
            Shutdown: self._shutdown,
            _Stop: self._shutdown,
        }
        self._context = zmq.Context()
        input_socket = self._context.socket(zmq.PULL)
        input_socket.bind(input_address)
        self.input_address = input_socket.getsockopt_string(zmq.LAST_ENDPOINT)
        output_socket = self._context.socket(zmq.PUSH)
        output_socket.setsockopt(zmq.SNDHWM, 0)  # never drop or block: queue instead
        output_socket.connect(output_address)
        self._input_thread = _start_thread("input", self._read_inputs, input_socket)
        self._output_thread = _start_thread("output", self._write_outputs, output_socket)

    def info(self) -> EngineCoreInfo:
        core = self.engine_core
        return EngineCoreInfo(
            attention_backend_name=core.attention_backend_name,
            num_kv_blocks=core.kv_cache_manager.num_blocks,
            block_size=core.kv_cache_manager.block_size,
            max_model_len=core.scheduler.limits.max_model_len,
            pid=os.getpid(),
            quantization=core.quantization.describe(core.config.torch_dtype),
            input_address=self.input_address,
            node=self.node,
            visible_devices=os.environ.get(VISIBLE_DEVICES_VARIABLE),
            memory_plan=core.memory_plan,
            kv_cache_dtype=core.config.kv_cache_dtype,
        )

    def watch_parent(self) -> None:
        """End the loop if the front end's process dies (its sentinel becomes readable)."""
        parent = multiprocessing.parent_process()
        if parent is not None:
            _start_thread("parent-watch", self._wait_for_parent, parent.sentinel)

    # ---- the busy loop -------------------------------------------------------------

    def run_busy_loop(self) -> None:
        """Serve until a :class:`Shutdown` (or the parent's death); then shut the core down."""
        try:
            while self._is_running:
                self._process_input_queue()
                if self._is_running and self.engine_core.has_unfinished_requests():
                    self._step()
        except Exception as exc:  # a bug outside step(): tell the front end, then exit
            logger.exception("engine core loop failed")
            self.output_queue.put(FatalError(f"{type(exc).__name__}: {exc}"))
            raise
        finally:
            self._close()

    def _close(self) -> None:
        try:
            self.engine_core.shutdown()
        finally:
            self.output_queue.put(None)
            self._output_thread.join(timeout=_OUTPUT_LINGER_MS / 1000 + 1)

    def _process_input_queue(self) -> None:
        if not self.engine_core.has_unfinished_requests():
            self._handle(self.input_queue.get())  # idle: sleep until there is news
        while self._is_running:
            try:
                message = self.input_queue.get_nowait()
            except queue.Empty:
                return
            self._handle(message)

    def _handle(self, message: CoreInput | _Stop) -> None:
        self._handlers[type(message)](message)

    def _step(self) -> None:
        try:
            outputs = self.engine_core.step()
        except ExecutorFailedError as exc:  # no later step can run: stop serving
            self._fail_unfinished_requests(exc)
            raise
        except Exception as exc:
            self._fail_unfinished_requests(exc)
            return
        if outputs.outputs:
            self.output_queue.put(StepOutputs(outputs.outputs))
        for failure in outputs.failures:  # each fails its request alone
            self.output_queue.put(
                RequestErrors(
                    [failure.request_id],
                    failure.message,
                    is_invalid_request=failure.is_invalid_request,
                )
            )

    def _fail_unfinished_requests(self, exc: Exception) -> None:
        """A failed step leaves its batch in an unknown state: finish every request as an
        error (freeing its blocks) and tell the front end, then keep serving."""
        self.num_failed_steps += 1
        logger.exception("engine core step failed; failing all unfinished requests")
        request_ids = self.engine_core.fail_unfinished_requests()
        message = f"the engine core's step failed: {type(exc).__name__}: {exc}"
        self.output_queue.put(RequestErrors(request_ids, message))

    # ---- handlers ------------------------------------------------------------------

    def _add_request(self, message: AddRequest) -> None:
        request = message.request
        try:
            self.engine_core.add_request(request)
        except InvalidRequestError as exc:  # this request can never run: reject it alone
            self.output_queue.put(
                RequestErrors([request.request_id], str(exc), is_invalid_request=True)
            )

    def _finish_requests(self, message: FinishRequests) -> None:
        self.engine_core.finish_requests(message.request_ids, message.status)

    def _get_stats(self, message: GetStats) -> None:
        occupancy = self.engine_core.occupancy()
        stats = EngineCoreStats(
            **dataclasses.asdict(occupancy),
            kv_cache_usage=occupancy.kv_cache_usage,
            num_failed_steps=self.num_failed_steps,
            totals=self.engine_core.step_totals,
        )
        self.output_queue.put(UtilityResult(message.call_id, stats=stats))

    def _shutdown(self, message: Shutdown | _Stop) -> None:
        if isinstance(message, _Stop):
            logger.warning("engine core stopping: %s", message.reason)
        self._is_running = False

    # ---- I/O threads ---------------------------------------------------------------

    def _read_inputs(self, socket: zmq.Socket) -> None:
        while True:
            data = socket.recv()
            try:
                message = input_decoder.decode(data)
            except Exception:  # a malformed message must not kill the reader
                logger.exception("engine core received an undecodable message")
                continue
            self.input_queue.put(message)
            if isinstance(message, Shutdown):
                socket.close(linger=0)
                return

    def _write_outputs(self, socket: zmq.Socket) -> None:
        while (message := self.output_queue.get()) is not None:
            socket.send(encoder.encode(message))
        socket.close(linger=_OUTPUT_LINGER_MS)

    def _wait_for_parent(self, sentinel: int) -> None:
        multiprocessing.connection.wait([sentinel])
        self.input_queue.put(_Stop("the front-end process is gone"))


def _start_thread(name: str, target: Callable[..., None], *args: Any) -> threading.Thread:
    thread = threading.Thread(
        target=target, args=args, name=f"vlite-engine-core-{name}", daemon=True
    )
    thread.start()
    return thread


def start_engine_core_proc(
    config_fields: dict[str, Any],
    input_address: str,
    output_address: str,
    engine_core_factory: EngineCoreFactory | None = None,
    node: str = "local",
) -> EngineCoreProc | StartupFailed:
    """Build the core and its :class:`EngineCoreProc`, or say why that failed (anything
    started on the way, such as executor workers, is stopped again)."""
    engine_core = None
    try:
        config = VliteConfig(**config_fields)
        engine_core = (engine_core_factory or EngineCore)(config, ModelSpec.from_config(config))
        return EngineCoreProc(engine_core, input_address, output_address, node)
    except BaseException as exc:
        if not isinstance(exc, (ValueError, FileNotFoundError)):  # else: a user error,
            logger.exception("engine core failed to start")  # which the front end reports
        if engine_core is not None:
            engine_core.shutdown()
        return StartupFailed(f"{type(exc).__name__}: {exc}")


def run_engine_core(
    config_fields: dict[str, Any],
    input_address: str,
    output_address: str,
    handshake: multiprocessing.connection.Connection,
    engine_core_factory: EngineCoreFactory | None = None,
    visible_devices: str | None = None,
) -> None:
    """The engine-core process's target: build the core, report ready, run the loop.

    The handshake connection gets exactly one message: :class:`Ready` with the core's
    :class:`EngineCoreInfo`, or :class:`StartupFailed` with the error. ``visible_devices``
    (data parallelism on GPUs) becomes this process's ``CUDA_VISIBLE_DEVICES`` before
    anything touches CUDA, so each core and its workers use their own GPUs.
    """
    # Ctrl-C reaches the whole process group; the front end decides when the core stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _exit_on_signal)
    if visible_devices is not None:
        os.environ[VISIBLE_DEVICES_VARIABLE] = visible_devices
    proc = start_engine_core_proc(config_fields, input_address, output_address, engine_core_factory)
    if isinstance(proc, StartupFailed):
        handshake.send_bytes(encoder.encode(proc))
        handshake.close()
        sys.stderr.flush()
        os._exit(1)  # skip interpreter teardown: nothing is left to clean up
    handshake.send_bytes(encoder.encode(Ready(proc.info())))
    handshake.close()
    proc.watch_parent()
    freeze_startup_heap()
    try:
        proc.run_busy_loop()
    except Exception:
        sys.exit(1)  # already reported to the front end and logged
    finally:
        _remove_ipc_files_if_orphaned(input_address)


def _remove_ipc_files_if_orphaned(address: str) -> None:
    """The front end removes its IPC directory when it stops; if it died instead (SIGKILL),
    the core removes it on its way out, so nothing is left in the temporary directory."""
    parent = multiprocessing.parent_process()
    folder = Path(address.removeprefix("ipc://")).parent
    if parent is not None and not parent.is_alive() and folder.name.startswith(IPC_DIR_PREFIX):
        shutil.rmtree(folder, ignore_errors=True)


def _exit_on_signal(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)
