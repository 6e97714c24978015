"""RayRankGroup: the engine's side of the ranks' Ray actors: start, call, watch, stop.

Start: connect to Ray (:mod:`.session`), reserve one bundle per rank (:mod:`.placement`),
start one :class:`~.rank_actor.RankWorker` actor in each bundle, ask each where it runs.
Load: rank 0's actor names a free port on its node; every rank joins the process group at
``tcp://<rank 0's node IP>:<port>`` and loads its shard.

Every call goes to every rank, and a wait for replies watches all of them (``ray.wait``
with a timeout, never an unbounded ``ray.get``), so a rank that raises or whose actor dies
(process killed, node gone) fails the wait at once, even while the other ranks are blocked
in a collective. The failure becomes a :class:`~.failures.RayWorkerError` naming each
failed rank with its node, and the group refuses further work.

Stop kills the actors, waits until Ray reports them gone, removes the placement group and
gives back this executor's use of the Ray connection.
"""

from __future__ import annotations

import contextlib
import functools
import pickle
import sys
import time
from typing import Any, NoReturn

from vlite.core.config import VliteConfig
from vlite.core.errors import PluginError
from vlite.plugins.executors.ray.failures import (
    RankFailure,
    RayWorkerError,
    combined_error,
    rank_failure,
    silent_rank,
)
from vlite.plugins.executors.ray.layout import RankRole, rank_roles
from vlite.plugins.executors.ray.placement import rank_bundle, reserve_bundles
from vlite.plugins.executors.ray.rank_actor import RankLocation, RankWorker
from vlite.plugins.executors.ray.session import connect, disconnect, import_ray
from vlite.plugins.executors.worker_pool import threads_per_worker
from vlite.worker.cpu_threads import thread_environment
from vlite.worker.protocol import ModelLoaded, WorkerBootstrap

#: How long one ``ray.wait`` blocks before waiting again (keeps the caller interruptible).
POLL_INTERVAL_S = 1.0
#: After a failure: how long to collect the other ranks' news for the error message.
FAILURE_GRACE_S = 0.5
#: How long :meth:`RayRankGroup.stop` waits for Ray to report the killed actors gone.
SHUTDOWN_GRACE_S = 5.0
#: Step inputs larger than this go through Ray's object store once for all ranks, instead of
#: travelling inside every rank's call (Ray's own limit for inlining arguments is 100 KiB).
INLINE_LIMIT_BYTES = 100 * 1024


@functools.cache
def _actor_class() -> Any:
    """:class:`RankWorker` as a Ray actor class (made once per process)."""
    return import_ray().remote(RankWorker)


class RayRankGroup:
    """Starts, calls, watches and stops one Ray actor per rank.

    Args:
        config: the engine configuration (``tensor_parallel_size *
            pipeline_parallel_size`` ranks).
        registry: the plugin registry handed to every rank (it must pickle).
        bundle_resources: custom resources each rank's bundle requests besides its own.
    """

    def __init__(
        self, config: VliteConfig, registry: Any, bundle_resources: dict[str, float]
    ) -> None:
        self.config = config
        self.registry = registry
        self.roles: list[RankRole] = rank_roles(
            config.tensor_parallel_size, config.pipeline_parallel_size
        )
        self.output_rank = next(role.rank for role in self.roles if role.returns_output)
        self.num_threads = threads_per_worker(len(self.roles), config.cpu_threads)
        self.on_gpu = config.torch_device.type == "cuda"
        self.error: RayWorkerError | None = None
        self.actors: list[Any] = []
        self.locations: dict[int, RankLocation] = {}
        self.placement_group: Any = None
        self._is_stopped = False
        self._is_connected = False
        try:
            self._start(bundle_resources)
        except BaseException:
            self.stop()
            raise

    # ---- start ---------------------------------------------------------------------

    def _start(self, bundle_resources: dict[str, float]) -> None:
        """Connect, reserve the bundles, start the actors, learn where they run."""
        connect(self.config.ray_address)
        self._is_connected = True
        device_type = "cuda" if self.on_gpu else "cpu"
        bundle = rank_bundle(device_type, self.num_threads, bundle_resources)
        self.placement_group = reserve_bundles(
            [dict(bundle) for _ in self.roles], self.config.ray_placement_strategy
        )
        self.actors = [self._start_actor(role) for role in self.roles]
        self.locations = self._call_all("location")

    def _start_actor(self, role: RankRole) -> Any:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        in_bundle = PlacementGroupSchedulingStrategy(
            placement_group=self.placement_group, placement_group_bundle_index=role.rank
        )
        return (
            _actor_class()
            .options(
                num_cpus=0 if self.on_gpu else self.num_threads,
                num_gpus=1 if self.on_gpu else 0,
                scheduling_strategy=in_bundle,
                runtime_env={"env_vars": self._environment(role)},
            )
            .remote(role)
        )

    def _environment(self, role: RankRole) -> dict[str, str]:
        """Thread-pool sizes (set before PyTorch starts); one set of progress bars."""
        environment = thread_environment(self.num_threads)
        if role.rank > 0:
            environment["TQDM_DISABLE"] = "1"
        return environment

    def load(self) -> list[ModelLoaded]:
        """Meet at rank 0, load every shard; every rank's report, in rank order."""
        init_method = self._rendezvous()
        payloads = {role.rank: (self._bootstrap_payload(role, init_method),) for role in self.roles}
        loaded = self._call_all("load", payloads)
        return [loaded[role.rank] for role in self.roles]

    def _rendezvous(self) -> str:
        """``tcp://`` at rank 0's node, on a port rank 0 found free there."""
        from vlite.distributed.process_group import tcp_init_method

        port = self._collect({0: self.actors[0].free_port.remote()})[0]
        return tcp_init_method(self.locations[0].node_ip, port)

    def _bootstrap_payload(self, role: RankRole, init_method: str) -> bytes:
        from ray import cloudpickle

        bootstrap = WorkerBootstrap(
            self.config,
            self.registry,
            role.rank,
            len(self.roles),
            init_method,
            self.num_threads,
            list(sys.path),
        )
        try:
            inner = cloudpickle.dumps(bootstrap)
        except Exception as exc:
            raise PluginError(
                "executor 'ray' hands the plugin registry to its Ray actors, but it cannot be "
                f"pickled ({type(exc).__name__}: {exc})"
            ) from exc
        return pickle.dumps((list(sys.path), inner))

    # ---- calls ---------------------------------------------------------------------

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self._call_all("initialize_kv_cache", {role.rank: (num_blocks,) for role in self.roles})

    def submit_step(self, scheduler_output: bytes) -> dict[int, Any]:
        """Send one encoded ``SchedulerOutput`` to every rank; the replies to come, by rank."""
        self._check_usable()
        argument: Any = scheduler_output
        if len(scheduler_output) > INLINE_LIMIT_BYTES:
            argument = import_ray().put(scheduler_output)
        return {rank: actor.execute_step.remote(argument) for rank, actor in enumerate(self.actors)}

    def collect_step(self, replies: dict[int, Any]) -> bytes:
        """Wait for every rank's reply to a step; the output rank's encoded output."""
        return self._collect(replies)[self.output_rank]

    def _call_all(self, method: str, arguments: dict[int, tuple] | None = None) -> dict[int, Any]:
        """Call ``method`` on every rank (with that rank's ``arguments``); replies by rank."""
        self._check_usable()
        refs = {
            rank: getattr(actor, method).remote(*(arguments or {}).get(rank, ()))
            for rank, actor in enumerate(self.actors)
        }
        return self._collect(refs)

    def _collect(self, refs: dict[int, Any]) -> dict[int, Any]:
        """Every rank's reply; the first failure anywhere raises (see :meth:`_fail`)."""
        self._check_usable()
        ray = import_ray()
        from ray.exceptions import RayError

        rank_of = {ref: rank for rank, ref in refs.items()}
        replies: dict[int, Any] = {}
        pending = list(refs.values())
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=POLL_INTERVAL_S)
            for ref in ready:
                try:
                    replies[rank_of[ref]] = ray.get(ref)
                except RayError as exc:
                    self._fail(
                        rank_failure(rank_of[ref], self._where(rank_of[ref]), exc),
                        {rank_of[other]: other for other in pending},
                    )
        return replies

    # ---- failures ------------------------------------------------------------------

    def _check_usable(self) -> None:
        if self.error is not None:
            raise RayWorkerError(f"the Ray workers failed earlier: {self.error}")
        if self._is_stopped:
            raise RayWorkerError("the Ray workers have been shut down")

    def _where(self, rank: int) -> str:
        location = self.locations.get(rank)
        return location.describe() if location is not None else "its node is not known yet"

    def _fail(self, first: RankFailure, pending: dict[int, Any]) -> NoReturn:
        """Record and raise ``first`` with whatever the other ranks report meanwhile."""
        failures = [first, *self._other_ranks_news(pending)]
        self.error = combined_error(failures)
        cause = next((f for f in failures if f.actor_is_gone), first).error
        raise self.error from cause

    def _other_ranks_news(self, pending: dict[int, Any]) -> list[RankFailure]:
        """Failures among ``pending`` (rank -> reply to come) within :data:`FAILURE_GRACE_S`,
        and the ranks still silent then."""
        if not pending:
            return []
        ray = import_ray()
        from ray.exceptions import RayError

        rank_of = {ref: rank for rank, ref in pending.items()}
        ready, silent = ray.wait(list(rank_of), num_returns=len(rank_of), timeout=FAILURE_GRACE_S)
        news = [
            silent_rank(rank_of[ref], self._where(rank_of[ref]), FAILURE_GRACE_S) for ref in silent
        ]
        for ref in ready:
            try:
                ray.get(ref)
            except RayError as exc:
                news.append(rank_failure(rank_of[ref], self._where(rank_of[ref]), exc))
        return news

    # ---- stop ----------------------------------------------------------------------

    def stop(self) -> None:
        """Kill the actors, remove the placement group, let go of Ray. Idempotent."""
        if self._is_stopped:
            return
        self._is_stopped = True
        try:
            self._release_cluster_resources()
        finally:
            if self._is_connected:
                self._is_connected = False
                disconnect()

    def _release_cluster_resources(self) -> None:
        ray = import_ray()
        if not ray.is_initialized():
            return  # Ray's exit handler ran first; the cluster ends this job's actors itself
        from ray.util.placement_group import remove_placement_group

        for actor in self.actors:
            with contextlib.suppress(Exception):  # already dead, or Ray going away
                ray.kill(actor, no_restart=True)
        self._wait_until_gone(self.actors)
        if self.placement_group is not None:
            with contextlib.suppress(Exception):
                remove_placement_group(self.placement_group)

    @staticmethod
    def _wait_until_gone(actors: list[Any]) -> None:
        """Until Ray reports every killed actor gone, at most :data:`SHUTDOWN_GRACE_S`.

        A call to a killed actor fails once Ray knows it is dead; until then it may still
        be answered (the kill is on its way).
        """
        ray = import_ray()
        deadline = time.monotonic() + SHUTDOWN_GRACE_S
        for actor in actors:
            while (remaining := deadline - time.monotonic()) > 0:
                try:
                    ray.get(actor.location.remote(), timeout=remaining)
                except Exception:  # gone (RayActorError), out of time, or Ray going away
                    break
                time.sleep(0.01)
