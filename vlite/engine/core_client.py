"""The front end's side of the process boundary: start, talk to, and stop an EngineCoreProc.

:class:`CoreProcess` owns the child process (spawn, startup handshake, stop) and
:class:`AsyncMPClient` the two ZMQ sockets AsyncLLM talks through::

    AsyncMPClient --PUSH (connect)--> input.sock  --PULL (bind)--> EngineCoreProc
    AsyncMPClient <--PULL (bind)--- output.sock <--PUSH (connect)-- EngineCoreProc

Sends are synchronous and never block (the connecting PUSH queues without limit), so an
abort can be sent from any code on the event loop, even a ``finally`` block. The process's
death is noticed by polling its sentinel next to the output socket: no request waits on
a dead process. Several cores (data parallelism) are driven by one AsyncMPClient each,
under a :class:`~vlite.engine.data_parallel_client.DataParallelClient`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import multiprocessing
import multiprocessing.connection
import shutil
import tempfile
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import zmq
import zmq.asyncio

from vlite.core.config import VliteConfig
from vlite.core.request import EngineCoreRequest, RequestStatus
from vlite.engine.core_messages import (
    AddRequest,
    CoreInput,
    EngineCoreInfo,
    EngineCoreStats,
    FatalError,
    FinishRequests,
    GetStats,
    Ready,
    RequestErrors,
    Shutdown,
    StepOutputs,
    UtilityResult,
    encoder,
    handshake_decoder,
    output_decoder,
)
from vlite.engine.engine_core_proc import IPC_DIR_PREFIX, EngineCoreFactory, run_engine_core
from vlite.engine.exceptions import EngineDeadError, EngineStartupError

#: Seconds a process that was asked to shut down gets before it is terminated, then killed.
SHUTDOWN_GRACE_S = 5.0


class CoreHandle(Protocol):
    """Where an engine core runs, as :class:`AsyncMPClient` sees it: a local process
    (:class:`CoreProcess`) or a Ray actor (:class:`~vlite.engine.ray_core.RayCore`)."""

    #: The front end binds its output socket here; the core connects to it.
    output_address: str

    @property
    def input_address(self) -> str:
        """The core's input socket (known once it is ready)."""

    @property
    def sentinel(self) -> int:
        """A file descriptor that becomes readable when the core is gone."""

    @property
    def description(self) -> str:
        """Names it in errors: ``pid 123``, ``Ray actor 4f.. on node 10.0.0.2``."""

    @property
    def is_alive(self) -> bool: ...

    @property
    def exitcode(self) -> int | None: ...

    def wait_until_ready(self, timeout_s: float | None = None) -> EngineCoreInfo: ...

    def join(self, timeout_s: float) -> None:
        """Wait (at most ``timeout_s``) for the core that is gone to be collected."""

    def stop(self, asked_to_stop: bool = False) -> None: ...


class CoreProcess:
    """The engine-core child process: spawned, waited on until ready, stopped.

    Args:
        config: the engine configuration (sent to the child as plain fields).
        engine_core_factory: builds the core in the child (default: ``EngineCore``).
        visible_devices: the child's ``CUDA_VISIBLE_DEVICES`` (``None``: inherited).
    """

    def __init__(
        self,
        config: VliteConfig,
        engine_core_factory: EngineCoreFactory | None = None,
        visible_devices: str | None = None,
    ) -> None:
        self.ipc_dir = Path(tempfile.mkdtemp(prefix=IPC_DIR_PREFIX))
        self.input_address = f"ipc://{self.ipc_dir / 'input.sock'}"
        self.output_address = f"ipc://{self.ipc_dir / 'output.sock'}"
        context = multiprocessing.get_context("spawn")
        self._handshake_reader, handshake_writer = context.Pipe(duplex=False)
        # Not a daemon: a daemon is killed abruptly at exit, which would skip the core's own
        # shutdown (and its workers'); shutdown() and the child's parent-watch end it instead.
        self.process = context.Process(
            target=run_engine_core,
            args=(
                config.model_dump(),
                self.input_address,
                self.output_address,
                handshake_writer,
                engine_core_factory,
                visible_devices,
            ),
            name="VliteEngineCore",
        )
        self._stop_state = {"asked_to_stop": False}
        self._finalizer = weakref.finalize(
            self, _stop_process, self.process, self.ipc_dir, self._stop_state
        )
        self.process.start()
        handshake_writer.close()

    @property
    def sentinel(self) -> int:
        """A file descriptor that becomes readable when the process exits."""
        return self.process.sentinel

    @property
    def description(self) -> str:
        return f"pid {self.process.pid}"

    def join(self, timeout_s: float) -> None:
        self.process.join(timeout_s)

    def wait_until_ready(self, timeout_s: float | None = None) -> EngineCoreInfo:
        """Block until the child reports ready; raise :class:`EngineStartupError` if it
        reports an error, exits, or (with ``timeout_s``) takes too long."""
        reader = self._handshake_reader
        try:
            ready = multiprocessing.connection.wait([reader, self.sentinel], timeout_s)
            if not ready:
                raise EngineStartupError(f"the engine core was not ready within {timeout_s} s")
            try:
                message = handshake_decoder.decode(reader.recv_bytes())
            except EOFError:
                self.process.join(SHUTDOWN_GRACE_S)
                raise EngineStartupError(
                    f"the engine core process exited during startup "
                    f"(exit code {self.process.exitcode}); see its log above"
                ) from None
        except BaseException:
            self.stop()
            raise
        finally:
            reader.close()
        if not isinstance(message, Ready):
            self.stop()
            raise EngineStartupError(f"the engine core failed to start: {message.message}")
        return message.info

    @property
    def is_alive(self) -> bool:
        return self.process.is_alive()

    @property
    def exitcode(self) -> int | None:
        return self.process.exitcode

    def stop(self, asked_to_stop: bool = False) -> None:
        """Wait for the process to exit (``asked_to_stop``: a Shutdown was sent), else end it.

        Idempotent; also runs when the object is collected or the interpreter exits.
        """
        self._stop_state["asked_to_stop"] = asked_to_stop
        self._finalizer()


def _stop_process(process, ipc_dir: Path, state: dict[str, bool]) -> None:
    if process.is_alive() and state["asked_to_stop"]:
        process.join(SHUTDOWN_GRACE_S)
    if process.is_alive():
        process.terminate()  # SIGTERM: the core shuts its executor down, then exits
        process.join(SHUTDOWN_GRACE_S)
    if process.is_alive():
        process.kill()
        process.join()
    shutil.rmtree(ipc_dir, ignore_errors=True)


class AsyncMPClient:
    """Sends requests to an engine-core process and receives its outputs, on asyncio.

    Construction spawns the process; :meth:`wait_until_ready` blocks until it is ready
    (the caller may do its own start-up work in between, in parallel with the child's).

    Args:
        config: the engine configuration.
        engine_core_factory: builds the core in the child (default: ``EngineCore``).
        on_stats: called with each statistics answer (``None`` for one that failed) the
            moment it arrives, in order with the outputs (a data-parallel router uses it).
        start_core: starts the core (default: a local :class:`CoreProcess`); a
            data-parallel client passes one that gives the core its GPUs or its Ray node.
    """

    def __init__(
        self,
        config: VliteConfig,
        engine_core_factory: EngineCoreFactory | None = None,
        *,
        on_stats: Callable[[EngineCoreStats | None], None] | None = None,
        start_core: Callable[[], CoreHandle] | None = None,
    ) -> None:
        self._dead_error: EngineDeadError | None = None
        self._is_shut_down = False
        self._asked_to_stop = False
        self._on_stats = on_stats
        self._call_ids = itertools.count()
        self._utility_calls: dict[int, asyncio.Future] = {}
        self._poller: zmq.asyncio.Poller | None = None
        self.process: CoreHandle = (
            start_core() if start_core is not None else CoreProcess(config, engine_core_factory)
        )
        self._context = zmq.Context()
        self._async_context = zmq.asyncio.Context()
        self._input_socket = self._context.socket(zmq.PUSH)
        self._input_socket.setsockopt(zmq.SNDHWM, 0)
        self._output_socket = self._async_context.socket(zmq.PULL)
        self._output_socket.setsockopt(zmq.RCVHWM, 0)
        self._output_socket.bind(self.process.output_address)
        self._info: EngineCoreInfo | None = None

    def wait_until_ready(self, timeout_s: float | None = None) -> EngineCoreInfo:
        """Block until the core is ready; on failure stop everything and raise
        :class:`EngineStartupError`. ``timeout_s=None`` waits as long as the process lives."""
        if self._info is None:
            try:
                info = self.process.wait_until_ready(timeout_s)
            except BaseException:
                self.shutdown()
                raise
            # Connected once the core has bound it (a Ray core picks its port then); the
            # connecting PUSH queues what is sent before the connection completes.
            self._input_socket.connect(info.input_address)
            self._info = info
        return self._info

    @property
    def info(self) -> EngineCoreInfo:
        """What the core reported at startup (after :meth:`wait_until_ready`)."""
        if self._info is None:
            raise RuntimeError("the engine core is not ready yet: call wait_until_ready()")
        return self._info

    @property
    def infos(self) -> list[EngineCoreInfo]:
        """:attr:`info` as a list of one, as :class:`DataParallelClient` has one per core."""
        return [self.info]

    @property
    def is_shut_down(self) -> bool:
        return self._is_shut_down

    @property
    def dead_error(self) -> EngineDeadError | None:
        """Why the engine core can no longer serve, or ``None`` while it can."""
        return self._dead_error

    # ---- front end -> core ---------------------------------------------------------

    def add_request(self, request: EngineCoreRequest) -> None:
        self._send(AddRequest(request))

    def add_requests(self, requests: list[EngineCoreRequest]) -> None:
        """Send requests that belong together (the samples of one ``n > 1`` request)."""
        for request in requests:
            self._send(AddRequest(request))

    def abort_requests(self, request_ids: list[str]) -> None:
        """Finish requests as aborted (freeing their blocks); a dead core is ignored."""
        if request_ids and self._dead_error is None and not self._is_shut_down:
            self._send(FinishRequests(request_ids, RequestStatus.FINISHED_ABORTED))

    def finish_requests(self, request_ids: list[str], status: RequestStatus) -> None:
        if request_ids and self._dead_error is None and not self._is_shut_down:
            self._send(FinishRequests(request_ids, status))

    async def get_stats(self) -> EngineCoreStats:
        """The core's counters. Answered through :meth:`get_output`, which must be running."""
        return await self.request_stats()

    async def get_stats_per_core(self) -> list[EngineCoreStats | None]:
        """``[the core's counters]``, or ``[None]`` once it is dead or shut down."""
        try:
            return [await self.get_stats()]
        except EngineDeadError:
            return [None]

    def request_stats(self) -> asyncio.Future[EngineCoreStats]:
        """Ask for the core's counters now; the future gets them once :meth:`get_output`
        (which must be running) receives the answer."""
        call_id = next(self._call_ids)
        self._send(GetStats(call_id))
        future = asyncio.get_running_loop().create_future()
        self._utility_calls[call_id] = future
        return future

    def _send(self, message: CoreInput) -> None:
        if self._dead_error is not None:
            raise self._dead_error
        if self._is_shut_down:
            raise EngineDeadError("the engine has been shut down")
        if self._info is None:
            raise RuntimeError("the engine core is not ready yet: call wait_until_ready()")
        self._input_socket.send(encoder.encode(message), flags=zmq.NOBLOCK)

    # ---- core -> front end ---------------------------------------------------------

    async def get_output(self) -> StepOutputs | RequestErrors:
        """The next outputs or request errors; utility results are routed on the way.

        Raises:
            EngineDeadError: the process has exited (or reported a fatal error).
        """
        while True:
            message = output_decoder.decode(await self._recv())
            if isinstance(message, UtilityResult):
                self._resolve_utility_call(message)
            elif isinstance(message, FatalError):
                raise self._mark_dead(f"it reported a fatal error: {message.message}")
            else:
                return message

    async def _recv(self) -> bytes:
        if self._dead_error is not None:
            raise self._dead_error
        with contextlib.suppress(zmq.Again):
            return self._output_socket.recv(flags=zmq.NOBLOCK).result()
        if self._poller is None:
            self._poller = zmq.asyncio.Poller()
            self._poller.register(self._output_socket, zmq.POLLIN)
            self._poller.register(self.process.sentinel, zmq.POLLIN)
        events = dict(await self._poller.poll())
        if self._output_socket in events:
            return await self._output_socket.recv()
        self.process.join(SHUTDOWN_GRACE_S)  # it has exited: collect its exit code
        raise self._mark_dead(f"it exited with code {self.process.exitcode}")

    def _resolve_utility_call(self, result: UtilityResult) -> None:
        if self._on_stats is not None:
            self._on_stats(result.stats)
        future = self._utility_calls.pop(result.call_id, None)
        if future is None or future.done():
            return
        if result.error is not None:
            future.set_exception(RuntimeError(result.error))
        else:
            future.set_result(result.stats)

    def _mark_dead(self, reason: str) -> EngineDeadError:
        if self._dead_error is None:
            self._dead_error = EngineDeadError(f"the engine core process died: {reason}")
            for future in self._utility_calls.values():
                if not future.done():
                    future.set_exception(self._dead_error)
        return self._dead_error

    # ---- shutdown ------------------------------------------------------------------

    def ask_to_stop(self) -> None:
        """Send the core a :class:`Shutdown` (once) without waiting for it to exit, so that
        several cores stop at the same time; :meth:`shutdown` then waits."""
        if self._asked_to_stop or self._is_shut_down:
            return
        if self._info is not None and self._dead_error is None and self.process.is_alive:
            self._input_socket.send(encoder.encode(Shutdown()), flags=zmq.NOBLOCK)
            self._asked_to_stop = True

    def shutdown(self) -> None:
        """Stop the process (asking nicely first) and close the sockets. Idempotent."""
        if self._is_shut_down:
            return
        self.ask_to_stop()
        self._is_shut_down = True
        self.process.stop(asked_to_stop=self._asked_to_stop)
        self._close_sockets()
        for future in self._utility_calls.values():
            if not future.done():
                future.set_exception(EngineDeadError("the engine has been shut down"))

    def _close_sockets(self) -> None:
        if self._poller is not None:
            self._poller.unregister(self._output_socket)
            self._poller.unregister(self.process.sentinel)
        self._input_socket.close(linger=0)
        self._output_socket.close(linger=0)
        self._context.term()
        self._async_context.term()
