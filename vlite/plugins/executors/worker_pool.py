"""WorkerProcessPool: the engine's side of N worker processes (one per rank: tensor-parallel
ranks times pipeline stages).

Workers are started with ``subprocess`` as ``python -m vlite.worker.worker_process FD``,
each with one end of a socket pair. Not ``multiprocessing``'s spawn context, because
that leaves its resource-tracker process behind as a child of the engine (shutdown must
leave none) and re-imports the user's ``__main__`` in every worker.

Failure detection never blocks: a wait for replies watches every worker's socket, and a
worker that dies closes its socket, which wakes the wait (exit codes are checked on a
timer too). Any failure becomes a :class:`WorkerProcessError` naming the rank, and the
pool refuses further work.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from multiprocessing.connection import Connection, wait
from typing import NoReturn

import msgspec

from vlite.core.config import VliteConfig
from vlite.core.errors import ExecutorFailedError, PluginError
from vlite.core.outputs import ModelRunnerOutput
from vlite.distributed import file_init_method
from vlite.worker.cpu_threads import resolve_cpu_threads, thread_environment
from vlite.worker.protocol import (
    FromWorker,
    InitializeKVCache,
    KVCacheReady,
    ModelLoaded,
    Shutdown,
    StepResult,
    WorkerBootstrap,
    WorkerFailure,
)

#: How often a wait for replies also checks worker exit codes.
POLL_INTERVAL_S = 1.0
#: How long workers get to exit after :class:`Shutdown` before they are terminated.
SHUTDOWN_GRACE_S = 5.0
#: After a failure: how long to collect the other ranks' news for the error message.
FAILURE_GRACE_S = 0.5


class WorkerProcessError(ExecutorFailedError):
    """A worker process raised, exited or closed its connection; the pool is unusable
    from then on."""


def threads_per_worker(world_size: int, cpu_threads: int | None = None) -> int:
    """``cpu_threads`` if set, else the physical cores split over ``world_size`` workers."""
    return resolve_cpu_threads(cpu_threads, world_size)


class WorkerProcessPool:
    """Starts, talks to and stops the worker processes of one executor.

    Args:
        config: the engine configuration (``tensor_parallel_size * pipeline_parallel_size``
            workers are started).
        registry: the plugin registry handed to every worker (it must pickle).
    """

    def __init__(self, config: VliteConfig, registry) -> None:
        self.world_size = config.tensor_parallel_size * config.pipeline_parallel_size
        #: The rank whose tokens come back: the last stage's first tensor-parallel rank.
        self.sampling_rank = (config.pipeline_parallel_size - 1) * config.tensor_parallel_size
        self.config = config
        self.error: WorkerProcessError | None = None
        self._decoder = msgspec.msgpack.Decoder(FromWorker)
        self._encoder = msgspec.msgpack.Encoder()
        self._is_stopped = False
        self._rendezvous_dir = tempfile.mkdtemp(prefix="vlite-tp-")
        self.processes: list[subprocess.Popen] = []
        self.connections: list[Connection] = []
        try:
            payloads = self._bootstrap_payloads(config, registry)
            for rank, payload in enumerate(payloads):
                self._launch(rank, payload)
        except BaseException:
            self.stop()
            raise

    # ---- start ---------------------------------------------------------------------

    def _bootstrap_payloads(self, config: VliteConfig, registry) -> list[bytes]:
        init_method = file_init_method(self._rendezvous_dir)
        num_threads = threads_per_worker(self.world_size, config.cpu_threads)
        payloads = []
        for rank in range(self.world_size):
            bootstrap = WorkerBootstrap(
                config, registry, rank, self.world_size, init_method, num_threads, list(sys.path)
            )
            try:
                inner = pickle.dumps(bootstrap)
            except Exception as exc:
                raise PluginError(
                    "executor 'multiproc' hands the plugin registry to its worker processes, "
                    f"but it cannot be pickled ({type(exc).__name__}: {exc}); register plugin "
                    "classes defined at module level"
                ) from exc
            payloads.append(pickle.dumps((list(sys.path), inner)))
        return payloads

    def _launch(self, rank: int, payload: bytes) -> None:
        ours, theirs = socket.socketpair()
        num_threads = threads_per_worker(self.world_size, self.config.cpu_threads)
        env = dict(os.environ, **thread_environment(num_threads))
        if rank > 0:
            env["TQDM_DISABLE"] = "1"  # one set of loading progress bars is enough
        try:
            process = subprocess.Popen(
                [sys.executable, "-m", "vlite.worker.worker_process", str(theirs.fileno())],
                pass_fds=(theirs.fileno(),),
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=_stderr_fd(),  # keep the engine's stdout for its own output
            )
        finally:
            theirs.close()
        self.processes.append(process)
        self.connections.append(Connection(ours.detach()))
        self.connections[-1].send_bytes(payload)

    # ---- talking -------------------------------------------------------------------

    def wait_until_loaded(self) -> list[ModelLoaded]:
        """Every rank's :class:`ModelLoaded`, in rank order."""
        replies = self._receive(set(range(self.world_size)), ModelLoaded)
        return [replies[rank] for rank in range(self.world_size)]

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.broadcast(self._encoder.encode(InitializeKVCache(num_blocks)))
        self._receive(set(range(self.world_size)), KVCacheReady)

    def broadcast(self, message: bytes) -> None:
        """Send one encoded message to every worker."""
        self._check_usable()
        for rank, conn in enumerate(self.connections):
            try:
                conn.send_bytes(message)
            except OSError as exc:
                self._fail(rank, f"its connection broke ({exc})")

    def receive_step_result(self) -> ModelRunnerOutput:
        """The sampling rank's tokens for the oldest step not received yet."""
        rank = self.sampling_rank
        return self._receive({rank}, StepResult)[rank].output

    def _receive(self, ranks: set[int], expected: type) -> dict[int, FromWorker]:
        """One ``expected`` message from each of ``ranks``; any other news is a failure."""
        self._check_usable()
        replies: dict[int, FromWorker] = {}
        rank_of = {conn: rank for rank, conn in enumerate(self.connections)}
        while len(replies) < len(ranks):
            ready = wait(list(rank_of), timeout=POLL_INTERVAL_S)
            if not ready:
                self._check_exit_codes()
            for conn in ready:
                rank = rank_of[conn]
                message = self._read(rank)
                if isinstance(message, WorkerFailure):
                    self._fail(rank, _describe_failure(message))
                if not isinstance(message, expected) or rank not in ranks or rank in replies:
                    self._fail(rank, f"it sent an unexpected {type(message).__name__}")
                replies[rank] = message
        return replies

    def _read(self, rank: int) -> FromWorker:
        try:
            data = self.connections[rank].recv_bytes()
        except (EOFError, OSError):
            self._fail(rank, self._describe_exit(rank), is_exit=True)
        return self._decoder.decode(data)

    # ---- failures ------------------------------------------------------------------

    def _check_usable(self) -> None:
        if self.error is not None:
            raise WorkerProcessError(f"the worker processes failed earlier: {self.error}")
        if self._is_stopped:
            raise WorkerProcessError("the worker processes have been shut down")

    def _check_exit_codes(self) -> None:
        for rank, process in enumerate(self.processes):
            if process.poll() is not None:
                self._fail(rank, self._describe_exit(rank), is_exit=True)

    def _describe_exit(self, rank: int) -> str:
        process = self.processes[rank]
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=FAILURE_GRACE_S)  # its socket closes just before it is reaped
        code = process.returncode
        if code is None:
            return "it closed its connection"
        if code < 0:
            return f"it was killed by signal {signal.Signals(-code).name}"
        return f"it exited with code {code}"

    def _fail(self, rank: int, cause: str, is_exit: bool = False) -> NoReturn:
        """Record and raise the failure, with whatever the other ranks report meanwhile.

        Ranks whose process ended come first: a rank that lost a peer fails in its next
        collective, and the peer's death is the cause worth reading.
        """
        problems = [(rank, cause, is_exit), *self._other_ranks_news(exclude=rank)]
        problems.sort(key=lambda problem: not problem[2])
        self.error = WorkerProcessError(
            "; ".join(
                f"worker rank {r} (pid {self.processes[r].pid}) failed: {c}" for r, c, _ in problems
            )
        )
        raise self.error

    def _other_ranks_news(self, exclude: int) -> list[tuple[int, str, bool]]:
        """``(rank, cause, whether the process ended)`` of other ranks that fail meanwhile."""
        news = []
        deadline = time.monotonic() + FAILURE_GRACE_S
        for rank, conn in enumerate(self.connections):
            if rank == exclude:
                continue
            try:
                if conn.poll(max(0.0, deadline - time.monotonic())):
                    message = self._decoder.decode(conn.recv_bytes())
                    if isinstance(message, WorkerFailure):
                        news.append((rank, _describe_failure(message), False))
            except (EOFError, OSError, msgspec.DecodeError):
                news.append((rank, self._describe_exit(rank), True))
        return news

    # ---- stop ----------------------------------------------------------------------

    def stop(self) -> None:
        """Ask every worker to exit, terminate those that do not in time. Idempotent."""
        if self._is_stopped:
            return
        self._is_stopped = True
        shutdown = self._encoder.encode(Shutdown())
        for conn in self.connections:
            with contextlib.suppress(OSError):
                conn.send_bytes(shutdown)
        grace = SHUTDOWN_GRACE_S if self.error is None else FAILURE_GRACE_S
        deadline = time.monotonic() + grace
        for process in self.processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=max(0.0, deadline - time.monotonic()))
        for process in self.processes:
            _terminate(process)
        for conn in self.connections:
            conn.close()
        shutil.rmtree(self._rendezvous_dir, ignore_errors=True)


def _terminate(process: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL; reaps the process either way."""
    if process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout=SHUTDOWN_GRACE_S)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def _describe_failure(failure: WorkerFailure) -> str:
    return (
        f"{failure.error_type}: {failure.message}\n"
        f"--- worker traceback ---\n{failure.traceback.rstrip()}"
    )


def _stderr_fd() -> int | None:
    """File descriptor 2 when it is open (workers' stdout goes there), else inherit."""
    try:
        os.fstat(2)
    except OSError:
        return None
    return 2
