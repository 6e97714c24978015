"""DataParallelClient: several engine-core processes behind one front end (data parallelism).

::

    AsyncLLM --add--> DataParallelClient --least loaded--> AsyncMPClient 0 <-> EngineCoreProc 0
       ^                    |                          \\-> AsyncMPClient 1 <-> EngineCoreProc 1
       |                    |  one reader task per core, all into one queue
       +--- get_output() <--+

Each core is a whole engine (its own executor, which may be tensor parallel, its own
scheduler and KV cache) built from the same config; the front end above (tokenizing,
detokenizing, streaming) stays one. The client offers :class:`AsyncMPClient`'s methods, so
:class:`~vlite.engine.async_llm.AsyncLLM` drives one or the other alike; with one core
AsyncLLM uses an AsyncMPClient directly and none of this runs.

- Routing: a new request (all the samples of an ``n > 1`` request together, so they share
  the prompt's cached blocks) goes to the least-loaded core,
  :class:`~vlite.engine.core_router.LeastLoadedRouter`'s rule. A request asks the cores for
  fresh load reports when their latest is older than :data:`LOAD_REPORT_MAX_AGE_S` (one
  question per core at a time; an idle server asks nothing).
- The request -> core map lives here: aborts and stop-string finishes go to the core that
  holds the request; an entry is forgotten when the request finishes, fails or is ended.
- Where the cores run (``backend``): ``"mp"``, local processes, each given its own GPUs on
  CUDA (:mod:`vlite.engine.core_devices`); ``"ray"``, Ray actors placed over the cluster's
  nodes, each holding its own GPUs or threads (:mod:`vlite.engine.ray_cores`).
- Death: the first core to die (its process exits, or it reports a fatal error) makes the
  whole client dead, with an :class:`EngineDeadError` naming that core; the requests still
  running on the other cores are aborted there (their blocks freed), and every request in
  flight fails at once, as when a server's only core dies. The cores that live on still
  answer statistics, so ``/metrics`` can tell which core died.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import time
from collections.abc import Callable, Iterable

from vlite.core.config import VliteConfig
from vlite.core.errors import ConfigError
from vlite.core.request import EngineCoreRequest, RequestStatus
from vlite.engine.core_client import AsyncMPClient, CoreHandle, CoreProcess
from vlite.engine.core_devices import split_devices, visible_device_ids
from vlite.engine.core_messages import EngineCoreInfo, EngineCoreStats, RequestErrors, StepOutputs
from vlite.engine.core_router import LeastLoadedRouter
from vlite.engine.engine_core_proc import VISIBLE_DEVICES_VARIABLE, EngineCoreFactory
from vlite.engine.exceptions import EngineDeadError, EngineStartupError

logger = logging.getLogger(__name__)

#: Seconds a core's load report may age before a new request asks it for a fresh one.
LOAD_REPORT_MAX_AGE_S = 0.05
#: Where data-parallel engine cores run: local processes, or Ray actors.
DATA_PARALLEL_BACKENDS = ("mp", "ray")


class DataParallelClient:
    """``num_cores`` engine-core processes, each behind its own :class:`AsyncMPClient`.

    Construction spawns every process (they load the model at the same time);
    :meth:`wait_until_ready` blocks until all are ready.

    Args:
        config: the engine configuration, the same for every core.
        num_cores: how many engine cores (at least 1).
        engine_core_factory: builds each core in its child (default: ``EngineCore``).
        backend: ``"mp"`` (local processes) or ``"ray"`` (Ray actors on the cluster).
        resources: with ``"ray"``, ``NAME=AMOUNT`` custom resources each core's bundle adds.

    Raises:
        ValueError: ``num_cores`` is less than 1, an unknown ``backend``, too few GPUs for
            one set per core, or a malformed ``resources`` entry.
    """

    def __init__(
        self,
        config: VliteConfig,
        num_cores: int,
        engine_core_factory: EngineCoreFactory | None = None,
        *,
        backend: str = "mp",
        resources: tuple[str, ...] = (),
    ) -> None:
        if num_cores < 1:
            raise ConfigError(f"data_parallel_size must be at least 1, got {num_cores}")
        if backend not in DATA_PARALLEL_BACKENDS:
            raise ConfigError(
                f"data_parallel_backend {backend!r} is not one of {list(DATA_PARALLEL_BACKENDS)}"
            )
        self.ray_placement = None
        self.router = LeastLoadedRouter(num_cores)
        self.clients: list[AsyncMPClient] = []
        #: Which core holds each request in flight (by core request id).
        self.core_of: dict[str, int] = {}
        self._outputs: asyncio.Queue[StepOutputs | RequestErrors | EngineDeadError] | None = None
        self._readers: list[asyncio.Task] = []
        self._dead_error: EngineDeadError | None = None
        self._is_shut_down = False
        self._last_question_at = [float("-inf")] * num_cores
        try:
            starters = self._core_starters(
                config, num_cores, engine_core_factory, backend, resources
            )
            for index, start_core in enumerate(starters):
                on_stats = functools.partial(self._take_load_report, index)
                self.clients.append(AsyncMPClient(config, on_stats=on_stats, start_core=start_core))
        except BaseException:
            self.shutdown()
            raise

    def _core_starters(
        self,
        config: VliteConfig,
        num_cores: int,
        factory: EngineCoreFactory | None,
        backend: str,
        resources: tuple[str, ...],
    ) -> list[Callable[[], CoreHandle]]:
        """How to start each core: in a local process (with its own GPUs on CUDA) or in a
        Ray actor in its bundle of the cores' placement group."""
        if backend == "ray":
            from vlite.engine.ray_cores import RayCore, RayCorePlacement

            self.ray_placement = placement = RayCorePlacement(config, num_cores, resources)
            return [
                functools.partial(RayCore, config, factory, placement.actor_options(core))
                for core in range(num_cores)
            ]
        devices = _devices_per_core(config, num_cores)
        return [
            functools.partial(CoreProcess, config, factory, devices[core])
            for core in range(num_cores)
        ]

    def wait_until_ready(self, timeout_s: float | None = None) -> EngineCoreInfo:
        """Block until every core is ready (``timeout_s`` bounds the whole wait); on a
        failure stop them all and raise :class:`EngineStartupError` naming the core."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        try:
            for index, client in enumerate(self.clients):
                remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
                try:
                    client.wait_until_ready(remaining)
                except EngineStartupError as exc:
                    raise EngineStartupError(f"{self._name(index)}: {exc}") from exc
        except BaseException:
            self.shutdown()
            raise
        return self.info

    # ---- properties ----------------------------------------------------------------

    @property
    def num_cores(self) -> int:
        return len(self.router.cores)

    @property
    def info(self) -> EngineCoreInfo:
        """Core 0's startup report (every core runs the same config)."""
        return self.clients[0].info

    @property
    def infos(self) -> list[EngineCoreInfo]:
        """Each core's startup report, in core order."""
        return [client.info for client in self.clients]

    @property
    def processes(self) -> list[CoreHandle]:
        return [client.process for client in self.clients]

    @property
    def is_shut_down(self) -> bool:
        return self._is_shut_down

    @property
    def dead_error(self) -> EngineDeadError | None:
        """Why the engine can no longer serve (a core died), or ``None`` while it can."""
        return self._dead_error

    def _name(self, index: int) -> str:
        return f"engine core {index} of {self.num_cores}"

    # ---- front end -> cores --------------------------------------------------------

    def add_request(self, request: EngineCoreRequest) -> None:
        self.add_requests([request])

    def add_requests(self, requests: list[EngineCoreRequest]) -> None:
        """Send requests that belong together to the least-loaded core."""
        if self._dead_error is not None:
            raise self._dead_error
        if self._is_shut_down:
            raise EngineDeadError("the engine has been shut down")
        self._start_readers()
        core = self.router.choose()
        self.clients[core].add_requests(requests)
        for request in requests:
            self.core_of[request.request_id] = core
        self.router.record_sent(core, len(requests))
        self._refresh_load_reports()

    def abort_requests(self, request_ids: list[str]) -> None:
        """Abort requests on the cores holding them (freeing their blocks)."""
        for core, ids in self._take(request_ids).items():
            self.clients[core].abort_requests(ids)

    def finish_requests(self, request_ids: list[str], status: RequestStatus) -> None:
        for core, ids in self._take(request_ids).items():
            self.clients[core].finish_requests(ids, status)

    def _take(self, request_ids: Iterable[str]) -> dict[int, list[str]]:
        """Forget requests the front end ends, grouped by their core (unknown ids: none)."""
        by_core: dict[int, list[str]] = {}
        for request_id in request_ids:
            core = self.core_of.pop(request_id, None)
            if core is not None:
                by_core.setdefault(core, []).append(request_id)
        for core, ids in by_core.items():
            self.router.record_withdrawn(core, len(ids))
        return by_core

    # ---- statistics ----------------------------------------------------------------

    async def get_stats(self) -> EngineCoreStats:
        """Every core's counters as one engine's (:meth:`EngineCoreStats.combined`).

        Raises:
            EngineDeadError: a core is dead, or the client is shut down.
        """
        parts = await self.get_stats_per_core()
        if any(part is None for part in parts):
            raise self._dead_error or EngineDeadError("the engine has been shut down")
        return EngineCoreStats.combined(parts)

    async def get_stats_per_core(self) -> list[EngineCoreStats | None]:
        """Each core's counters, in core order (``None`` for a dead core)."""
        self._start_readers()
        return list(await asyncio.gather(*map(self._stats_or_none, range(self.num_cores))))

    async def _stats_or_none(self, core: int) -> EngineCoreStats | None:
        try:
            return await self._ask_for_stats(core)
        except EngineDeadError:
            return None

    def _ask_for_stats(self, core: int) -> asyncio.Future[EngineCoreStats]:
        future = self.clients[core].request_stats()
        self.router.record_question(core)
        self._last_question_at[core] = time.monotonic()
        return future

    def _refresh_load_reports(self) -> None:
        """Ask each core whose load report is stale for a new one, without waiting."""
        now = time.monotonic()
        for core, asked_at in enumerate(self._last_question_at):
            if now - asked_at < LOAD_REPORT_MAX_AGE_S or self.router.is_awaiting_answer(core):
                continue
            with contextlib.suppress(EngineDeadError):
                self._ask_for_stats(core).add_done_callback(_ignore_result)

    def _take_load_report(self, core: int, stats: EngineCoreStats | None) -> None:
        load = None if stats is None else stats.num_waiting_requests + stats.num_running_requests
        self.router.record_answer(core, load)

    # ---- cores -> front end --------------------------------------------------------

    async def get_output(self) -> StepOutputs | RequestErrors:
        """The next outputs or request errors of any core, each core's in order.

        Raises:
            EngineDeadError: a core has died (after the outputs that arrived before).
        """
        self._start_readers()
        if self._outputs is None:
            raise EngineDeadError("the engine has been shut down")
        if self._dead_error is not None and self._outputs.empty():
            raise self._dead_error
        message = await self._outputs.get()
        if isinstance(message, EngineDeadError):
            raise message
        return message

    def _start_readers(self) -> None:
        if self._readers or self._is_shut_down:
            return
        self._outputs = asyncio.Queue()
        loop = asyncio.get_running_loop()
        self._readers = [
            loop.create_task(self._read_core(core), name=f"vlite-dp-reader-{core}")
            for core in range(self.num_cores)
        ]

    async def _read_core(self, core: int) -> None:
        """Move one core's messages to the shared queue (statistics answers are resolved
        on the way), until it dies or the client shuts down."""
        client = self.clients[core]
        try:
            while True:
                message = await client.get_output()
                self._forget_ended(core, message)
                if self._dead_error is None:
                    self._outputs.put_nowait(message)
        except EngineDeadError as exc:
            self._on_core_death(core, str(exc))
        except Exception as exc:
            logger.exception("reading the outputs of %s failed", self._name(core))
            self._on_core_death(core, f"reading its outputs failed: {exc!r}")

    def _forget_ended(self, core: int, message: StepOutputs | RequestErrors) -> None:
        if isinstance(message, RequestErrors):
            ended = message.request_ids
        else:
            ended = [output.request_id for output in message.outputs if output.is_finished]
        count = sum(self.core_of.pop(request_id, None) is not None for request_id in ended)
        if count:
            self.router.record_finished(core, count)

    def _on_core_death(self, core: int, reason: str) -> None:
        """The first death kills the client: abort the requests on the other cores and
        wake :meth:`get_output` with the error (after what is already queued)."""
        if self._dead_error is not None or self._is_shut_down:
            return
        where = self.clients[core].process.description
        self._dead_error = EngineDeadError(f"{self._name(core)} ({where}): {reason}")
        logger.error("%s", self._dead_error)
        self.abort_requests(list(self.core_of))
        self._outputs.put_nowait(self._dead_error)

    # ---- shutdown ------------------------------------------------------------------

    def shutdown(self) -> None:
        """Stop every core (all asked at once, then each waited for) and the reader tasks.
        Idempotent."""
        if self._is_shut_down:
            return
        self._is_shut_down = True
        self._stop_readers()
        for client in self.clients:
            client.ask_to_stop()
        for client in self.clients:
            client.shutdown()
        if self.ray_placement is not None:
            self.ray_placement.release()

    def _stop_readers(self) -> None:
        tasks = [task for task in self._readers if not task.done()]
        for task in tasks:
            task.cancel()
        if tasks:
            loop = tasks[0].get_loop()
            if not loop.is_running() and not loop.is_closed():  # called from outside the loop
                loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))


def _devices_per_core(config: VliteConfig, num_cores: int) -> list[str | None]:
    """Each local core's ``CUDA_VISIBLE_DEVICES`` on CUDA (its ranks' GPUs, none shared);
    ``None`` (inherit) on CPU, or when the ``ray`` executor places the ranks."""
    if config.torch_device.type != "cuda" or config.executor == "ray":
        return [None] * num_cores
    import torch

    ranks = config.tensor_parallel_size * config.pipeline_parallel_size
    visible = visible_device_ids(
        os.environ.get(VISIBLE_DEVICES_VARIABLE), torch.cuda.device_count()
    )
    return list(split_devices(num_cores, ranks, visible))


def _ignore_result(future: asyncio.Future) -> None:
    """Retrieve a fire-and-forget future's outcome, so a failure is not reported unread."""
    if not future.cancelled():
        future.exception()
