"""Data-parallel engine cores as Ray actors, on any node of a Ray cluster.

``vlite serve -dp N --data-parallel-backend ray`` runs each engine core in a Ray actor
instead of a local process. The front end talks to it exactly as to a local core
(:class:`~vlite.engine.core_client.AsyncMPClient`), over TCP instead of IPC sockets::

    front end (driver)                                 node B
    AsyncMPClient --PUSH (connect)--> tcp://B:port --PULL (bind)--> EngineCoreActor
    AsyncMPClient <--PULL (bind)-- tcp://A:port <--PUSH (connect)-- EngineCoreActor

- :class:`RayCorePlacement` connects to Ray (``ray_address``) and reserves one bundle per
  core (strategy ``SPREAD``: replicas go to different nodes where they can): the core's own
  ranks' resources (``cpu_threads`` per rank on CPU, one GPU per rank on CUDA, so Ray gives
  each core its own GPUs) plus ``data_parallel_resources``. A core whose executor is
  ``ray`` reserves one CPU for itself: its ranks are placed by its own executor.
- :class:`RayCore` is the front end's handle on one actor, with the interface of a local
  :class:`~vlite.engine.core_client.CoreProcess`: a startup handshake
  (:meth:`EngineCoreActor.start`), then the busy loop as one long actor call
  (:meth:`EngineCoreActor.run`), watched by a thread that makes :attr:`RayCore.sentinel`
  readable when that call ends, so the client notices a dead actor (process killed, node
  lost) as it notices a dead process.
- Stopping: a ``Shutdown`` message (sent by the client), then the actor is killed after
  :data:`~vlite.engine.core_client.SHUTDOWN_GRACE_S` if it has not ended; the placement
  group is removed, and the Ray connection given back.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
from typing import Any

from vlite.core.config import VliteConfig
from vlite.distributed.process_group import free_tcp_port
from vlite.engine.core_messages import (
    EngineCoreInfo,
    Ready,
    StartupFailed,
    encoder,
    handshake_decoder,
)
from vlite.engine.engine_core_proc import EngineCoreFactory, start_engine_core_proc
from vlite.engine.exceptions import EngineStartupError
from vlite.engine.startup_heap import freeze_startup_heap
from vlite.plugins.executors.ray.placement import parse_bundle_resources, reserve_bundles
from vlite.plugins.executors.ray.session import connect, disconnect, import_ray
from vlite.plugins.executors.worker_pool import threads_per_worker
from vlite.worker.cpu_threads import thread_environment

logger = logging.getLogger(__name__)

#: Seconds an actor asked to shut down gets before it is killed.
SHUTDOWN_GRACE_S = 5.0


class EngineCoreActor:
    """The code inside a core's actor (a plain class; :func:`_actor_class` wraps it).

    Args:
        config_fields: the engine configuration as plain fields.
        output_address: the front end's output socket (``tcp://HOST:PORT``).
        engine_core_factory: builds the core (default: ``EngineCore``).
    """

    def __init__(
        self,
        config_fields: dict[str, Any],
        output_address: str,
        engine_core_factory: EngineCoreFactory | None = None,
    ) -> None:
        self._arguments = (config_fields, output_address, engine_core_factory)
        self._proc = None

    def start(self) -> bytes:
        """Build the core, bind its input to a free port on this node; the encoded
        :class:`Ready` (naming that address and the node) or :class:`StartupFailed`."""
        config_fields, output_address, factory = self._arguments
        ray = import_ray()
        node_ip = ray.util.get_node_ip_address()
        node = f"{node_ip}, node id {ray.get_runtime_context().get_node_id()}"
        result = start_engine_core_proc(
            config_fields, f"tcp://{node_ip}:*", output_address, factory, node=node
        )
        if isinstance(result, StartupFailed):
            return encoder.encode(result)
        self._proc = result
        return encoder.encode(Ready(result.info()))

    def run(self) -> None:
        """Serve until a ``Shutdown`` message (the call lasts as long as the core)."""
        if self._proc is None:
            raise RuntimeError("start() must succeed before run()")
        freeze_startup_heap()
        self._proc.run_busy_loop()


@functools.cache
def _actor_class() -> Any:
    return import_ray().remote(EngineCoreActor)


class RayCore:
    """One engine core in a Ray actor, as the front end sees it (a ``CoreHandle``).

    Args:
        config: the engine configuration.
        engine_core_factory: builds the core in the actor (default: ``EngineCore``).
        actor_options: Ray options of the actor (resources, scheduling strategy).
    """

    def __init__(
        self,
        config: VliteConfig,
        engine_core_factory: EngineCoreFactory | None,
        actor_options: dict[str, Any],
    ) -> None:
        ray = import_ray()
        host = ray.util.get_node_ip_address()
        self.output_address = f"tcp://{host}:{free_tcp_port(host)}"
        self._ray = ray
        self.actor = (
            _actor_class()
            .options(**actor_options)
            .remote(config.model_dump(), self.output_address, engine_core_factory)
        )
        self._start_call = self.actor.start.remote()
        self._run_call: Any = None
        self._info: EngineCoreInfo | None = None
        self._exitcode: int | None = None
        self._end_reason = ""
        self._read_end, self._write_end = os.pipe()
        self._watcher: threading.Thread | None = None
        self._is_stopped = False

    # ---- the CoreHandle interface --------------------------------------------------

    @property
    def input_address(self) -> str:
        return self._info.input_address if self._info is not None else ""

    @property
    def sentinel(self) -> int:
        """Readable once the actor's serving call has ended (returned, raised or died)."""
        return self._read_end

    @property
    def description(self) -> str:
        node = self._info.node if self._info is not None else "not yet known"
        actor_id = self.actor._actor_id.hex()[:12]
        reason = f"; {self._end_reason}" if self._end_reason else ""
        return f"Ray actor {actor_id} on node {node}{reason}"

    @property
    def is_alive(self) -> bool:
        return self._exitcode is None and not self._is_stopped

    @property
    def exitcode(self) -> int | None:
        """0 once the core has served and shut down, 1 if it failed or its actor died."""
        return self._exitcode

    def wait_until_ready(self, timeout_s: float | None = None) -> EngineCoreInfo:
        """Block until the actor reports ready; raise :class:`EngineStartupError` if it
        reports an error, dies, or (with ``timeout_s``) takes too long."""
        try:
            ready, _ = self._ray.wait([self._start_call], timeout=timeout_s)
            if not ready:
                raise EngineStartupError(f"the engine core was not ready within {timeout_s} s")
            try:
                message = handshake_decoder.decode(self._ray.get(self._start_call))
            except self._ray.exceptions.RayError as exc:
                raise EngineStartupError(f"the engine core's Ray actor died: {exc}") from exc
            if not isinstance(message, Ready):
                raise EngineStartupError(f"the engine core failed to start: {message.message}")
        except BaseException:
            self.stop()
            raise
        self._info = message.info
        self._run_call = self.actor.run.remote()
        self._watcher = threading.Thread(
            target=self._watch_run_call, name="vlite-ray-core-watch", daemon=True
        )
        self._watcher.start()
        return message.info

    def join(self, timeout_s: float) -> None:
        if self._watcher is not None:
            self._watcher.join(timeout_s)

    def stop(self, asked_to_stop: bool = False) -> None:
        """Let a core that was asked to shut down end its call, kill its actor. Idempotent."""
        if self._is_stopped:
            return
        self._is_stopped = True
        if asked_to_stop and self._run_call is not None:
            with contextlib.suppress(Exception):
                self._ray.wait([self._run_call], timeout=SHUTDOWN_GRACE_S)
        with contextlib.suppress(Exception):
            self._ray.kill(self.actor, no_restart=True)
        self.join(SHUTDOWN_GRACE_S)
        for end in (self._read_end, self._write_end):
            with contextlib.suppress(OSError):
                os.close(end)

    def _watch_run_call(self) -> None:
        try:
            self._ray.get(self._run_call)
            self._exitcode = 0
        except Exception as exc:
            self._exitcode = 1
            self._end_reason = _first_line(str(exc))
            # Ray's message carries the remote traceback: keep all of it in the log.
            logger.error("the engine-core actor ended with an error:\n%s", exc)
        with contextlib.suppress(OSError):
            os.write(self._write_end, b"\0")


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else "its actor ended"


class RayCorePlacement:
    """The Ray connection and placement group that hold ``num_cores`` engine-core actors.

    Args:
        config: the engine configuration of every core.
        num_cores: how many cores.
        resources: ``NAME=AMOUNT`` custom resources each core's bundle adds.

    Raises:
        RayNotInstalledError: Ray cannot be imported (``pip install "vlite[ray]"``).
        ValueError: a malformed ``resources`` entry.
        RayPlacementError: the cluster cannot hold one bundle per core.
    """

    def __init__(self, config: VliteConfig, num_cores: int, resources: tuple[str, ...]) -> None:
        import_ray()
        custom = parse_bundle_resources(resources)
        self.bundle = core_bundle(config, custom)
        self._thread_environment = self._threads_of(config)
        connect(config.ray_address)
        self._is_connected = True
        self.placement_group: Any = None
        try:
            self.placement_group = reserve_bundles([dict(self.bundle)] * num_cores, "SPREAD")
        except BaseException:
            self.release()
            raise

    @staticmethod
    def _threads_of(config: VliteConfig) -> dict[str, str]:
        ranks = config.tensor_parallel_size * config.pipeline_parallel_size
        if config.torch_device.type == "cuda" or config.executor == "ray":
            return {}
        return thread_environment(threads_per_worker(ranks, config.cpu_threads))

    def actor_options(self, core: int) -> dict[str, Any]:
        """Where core ``core``'s actor goes (its bundle) and what it holds there."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        custom = {k: v for k, v in self.bundle.items() if k not in ("CPU", "GPU")}
        return {
            "num_cpus": self.bundle.get("CPU", 0),
            "num_gpus": self.bundle.get("GPU", 0),
            "resources": custom,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                placement_group=self.placement_group, placement_group_bundle_index=core
            ),
            "runtime_env": {"env_vars": self._thread_environment},
        }

    def release(self) -> None:
        """Remove the placement group and give back the connection. Idempotent."""
        if self.placement_group is not None:
            from ray.util.placement_group import remove_placement_group

            with contextlib.suppress(Exception):
                remove_placement_group(self.placement_group)
            self.placement_group = None
        if self._is_connected:
            self._is_connected = False
            disconnect()


def core_bundle(config: VliteConfig, custom: dict[str, float]) -> dict[str, float]:
    """One core's bundle: its ranks' GPUs (CUDA) or threads (CPU), or one CPU for a core
    whose ``ray`` executor places its ranks itself; plus the ``custom`` resources."""
    ranks = config.tensor_parallel_size * config.pipeline_parallel_size
    if config.executor == "ray":
        own = {"CPU": 1.0}
    elif config.torch_device.type == "cuda":
        own = {"GPU": float(ranks)}
    else:
        own = {"CPU": float(ranks * threads_per_worker(ranks, config.cpu_threads))}
    return {**own, **custom}
