"""``multiproc``: one worker process per rank (tensor-parallel ranks x pipeline stages).

Each step's :class:`~vlite.core.outputs.SchedulerOutput` is msgpack-encoded once and sent
to every worker; each worker runs its shard's forward pass and samples. Every rank holds
the full logits (the LM head all-gathers them) and the same per-request generators, so
every rank samples the same tokens and keeps the same token lists without a broadcast;
only rank 0's tokens travel back. (The logits are identical bit for bit on every rank:
they are copies made by the all-gather, computed from hidden states that the all-reduces
leave identical on every rank.)

KV-cache blocks: each rank sizes its own cache from its own memory budget (a pipeline
stage's cache holds only its own layers); the engine uses the smallest count, so every rank
can hold every block the scheduler hands out.

Pipeline parallelism: every rank gets every step's message; a stage receives its input from
the stage before over ``torch.distributed`` and starts on the next message as soon as it has
handed its output on, so with ``pp`` batches in flight (the engine's batch queue) all stages
work at once. Only the last stage samples, and its first rank replies; replies come back in
the order the batches were sent, which :meth:`MultiprocExecutor.execute_model_async`'s
futures rely on.
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future

from vlite.core.config import VliteConfig
from vlite.core.hookspecs import hookimpl
from vlite.core.outputs import ModelRunnerOutput, SchedulerOutput
from vlite.core.plugins import PluginRegistry
from vlite.plugins.executors.remote_workers import RemoteWorkersExecutor
from vlite.plugins.executors.worker_pool import WorkerProcessPool
from vlite.worker.protocol import ExecuteStep


class MultiprocExecutor(RemoteWorkersExecutor):
    """Runs ``tensor_parallel_size`` workers in child processes, tensor parallel.

    Workers are started and load their shards during construction. A worker that raises,
    exits or is killed makes the next (or current) call raise
    :class:`~vlite.plugins.executors.worker_pool.WorkerProcessError` naming the rank and
    the cause. :meth:`shutdown` (also run when the executor is garbage-collected or the
    interpreter exits) stops every worker process.
    """

    def __init__(self, config: VliteConfig, registry: PluginRegistry) -> None:
        super().__init__(config, registry)
        self.pool = WorkerProcessPool(config, registry)
        self._awaiting: deque[_ReplyFuture] = deque()
        self.adopt_ranks(self.pool, self.pool.wait_until_loaded)

    def execute_model(self, scheduler_output: SchedulerOutput) -> None:
        self.pool.broadcast(self._encoder.encode(ExecuteStep(scheduler_output)))

    def sample_tokens(self) -> ModelRunnerOutput:
        return self.pool.receive_step_result()

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> Future[ModelRunnerOutput]:
        """Send the batch to every rank and return at once; the future's ``result()`` reads
        replies, oldest first, until its own has come."""
        self.execute_model(scheduler_output)
        future = _ReplyFuture(self._receive_oldest)
        self._awaiting.append(future)
        return future

    def _receive_oldest(self) -> None:
        future = self._awaiting.popleft()
        try:
            future.set_result(self.sample_tokens())
        except BaseException as exc:
            future.set_exception(exc)
            while self._awaiting:  # the pool refuses further work: so do the later ones
                self._awaiting.popleft().set_exception(exc)


class _ReplyFuture(Future):
    """A future filled on demand: ``result()`` pulls replies until this one has come."""

    def __init__(self, pull) -> None:
        super().__init__()
        self._pull = pull

    def result(self, timeout: float | None = None) -> ModelRunnerOutput:
        while not self.done():
            self._pull()
        return super().result(timeout)


@hookimpl
def register_executors(register):
    register("multiproc", MultiprocExecutor)
