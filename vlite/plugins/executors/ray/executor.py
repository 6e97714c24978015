"""RayExecutor: one Ray actor per rank (tensor-parallel ranks x pipeline stages), on one
machine or a Ray cluster.

The ranks run the same :class:`~vlite.worker.worker.Worker` as ``multiproc``'s worker
processes, placed by a placement group (one bundle per rank, see :mod:`.placement`), meeting
over TCP at rank 0's node. Each step's :class:`~vlite.core.outputs.SchedulerOutput` is
msgpack-encoded once and sent to every rank in one remote call each; every rank samples the
same tokens (see :mod:`vlite.plugins.executors.multiproc`), and only the output rank's
travel back, while the other ranks' replies are still waited for so that a failure anywhere
surfaces (see :mod:`.rank_group`). With pipeline stages the stages hand their hidden states
on over ``torch.distributed`` as under ``multiproc``; each actor runs its calls in order, so
``pipeline_parallel_size`` steps are kept in flight.
"""

from __future__ import annotations

from concurrent.futures import Future

import msgspec

from vlite.core.config import VliteConfig
from vlite.core.outputs import ModelRunnerOutput, SchedulerOutput
from vlite.core.plugins import PluginRegistry
from vlite.plugins.executors.ray.pending_step import PendingStep
from vlite.plugins.executors.ray.placement import parse_bundle_resources
from vlite.plugins.executors.ray.rank_group import RayRankGroup
from vlite.plugins.executors.ray.session import import_ray
from vlite.plugins.executors.remote_workers import RemoteWorkersExecutor


class RayExecutor(RemoteWorkersExecutor):
    """Runs ``tensor_parallel_size x pipeline_parallel_size`` ranks as Ray actors.

    Construction connects to Ray (``ray_address``; see :mod:`.session`), reserves the
    placement group (``ray_placement_strategy``, ``ray_bundle_resources``), starts the
    actors and loads their shards. A rank that raises, or whose actor dies or becomes
    unreachable, makes the current (or next) call raise
    :class:`~vlite.plugins.executors.ray.failures.RayWorkerError` naming the rank and its
    node; no call is accepted after that. :meth:`shutdown` (also run when the executor is
    garbage-collected or the interpreter exits) kills the actors, removes the placement
    group, and disconnects from Ray if vlite connected (stopping a local Ray it started).

    Raises:
        RayNotInstalledError: Ray cannot be imported (``pip install "vlite[ray]"``).
        ConfigError: a malformed ``ray_bundle_resources`` entry. (A tensor-parallel size
            or pipeline split the model cannot take is refused earlier, by the engine's
            configuration phase, :mod:`vlite.core.verify`.)
        RayPlacementError: the cluster cannot hold one bundle per rank.
    """

    def __init__(self, config: VliteConfig, registry: PluginRegistry) -> None:
        super().__init__(config, registry)
        import_ray()
        bundle_resources = parse_bundle_resources(config.ray_bundle_resources)
        self.group = RayRankGroup(config, registry, bundle_resources)
        self._output_decoder = msgspec.msgpack.Decoder(ModelRunnerOutput)
        self._step: PendingStep | None = None
        self.adopt_ranks(self.group, self.group.load)

    def execute_model(self, scheduler_output: SchedulerOutput) -> None:
        self._step = self.execute_model_async(scheduler_output)

    def sample_tokens(self) -> ModelRunnerOutput:
        step, self._step = self._step, None
        if step is None:
            raise RuntimeError("sample_tokens() needs an execute_model() call before it")
        return step.result()

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> Future[ModelRunnerOutput]:
        """Send the step to every rank and return at once (a :class:`PendingStep`)."""
        group, decode = self.group, self._output_decoder.decode
        replies = group.submit_step(self._encoder.encode(scheduler_output))
        return PendingStep(lambda: decode(group.collect_step(replies)))
