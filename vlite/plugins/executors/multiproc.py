"""``multiproc``: one worker process per tensor-parallel rank.

Each step's :class:`~vlite.core.outputs.SchedulerOutput` is msgpack-encoded once and sent
to every worker; each worker runs its shard's forward pass and samples. Every rank holds
the full logits (the LM head all-gathers them) and the same per-request generators, so
every rank samples the same tokens and keeps the same token lists without a broadcast;
only rank 0's tokens travel back. (The logits are identical bit for bit on every rank:
they are copies made by the all-gather, computed from hidden states that the all-reduces
leave identical on every rank.)

KV-cache blocks: each rank sizes its own cache from its own memory budget; the engine
uses the smallest count, so every rank can hold every block the scheduler hands out.
"""

from __future__ import annotations

import weakref

import msgspec

from vlite.core.config import VliteConfig
from vlite.core.executor import Executor
from vlite.core.hookspecs import hookimpl
from vlite.core.outputs import ModelRunnerOutput, SchedulerOutput
from vlite.core.plugins import PluginRegistry
from vlite.models.spec import ModelSpec
from vlite.plugins.executors.worker_pool import WorkerProcessPool
from vlite.worker.protocol import ExecuteStep


class MultiprocExecutor(Executor):
    """Runs ``tensor_parallel_size`` workers in child processes, tensor parallel.

    Workers are started and load their shards during construction. A worker that raises,
    exits or is killed makes the next (or current) call raise
    :class:`~vlite.plugins.executors.worker_pool.WorkerProcessError` naming the rank and
    the cause. :meth:`shutdown` (also run when the executor is garbage-collected or the
    interpreter exits) stops every worker process.
    """

    runs_workers_in_subprocesses = True
    supports_tensor_parallel = True

    def __init__(self, config: VliteConfig, registry: PluginRegistry) -> None:
        super().__init__(config, registry)
        check_model_splits(config, registry)
        self.pool = WorkerProcessPool(config, registry)
        self._finalizer = weakref.finalize(self, self.pool.stop)
        try:
            loaded = self.pool.wait_until_loaded()
        except BaseException:
            self.shutdown()
            raise
        self.attention_backend_name = loaded[0].attention_backend_name
        self._num_kv_blocks_per_rank = [reply.num_kv_blocks for reply in loaded]
        self._encoder = msgspec.msgpack.Encoder()

    def initialize_kv_cache(self) -> int:
        num_blocks = min(self._num_kv_blocks_per_rank)
        self.pool.initialize_kv_cache(num_blocks)
        return num_blocks

    def execute_model(self, scheduler_output: SchedulerOutput) -> None:
        self.pool.broadcast(self._encoder.encode(ExecuteStep(scheduler_output)))

    def sample_tokens(self) -> ModelRunnerOutput:
        return self.pool.receive_step_result()

    def shutdown(self) -> None:
        self._finalizer()


def check_model_splits(config: VliteConfig, registry: PluginRegistry) -> None:
    """Fail fast, before any process starts, when the model cannot be split ``tp`` ways."""
    tp = config.tensor_parallel_size
    if tp == 1:
        return
    spec = ModelSpec.from_config(config)
    model_cls = registry.get("model", spec.architecture)
    if not getattr(model_cls, "supports_tensor_parallel", False):
        raise ValueError(
            f"model class {model_cls.__qualname__} ({spec.architecture}) does not support "
            f"tensor parallelism; tensor_parallel_size={tp} needs one that does"
        )
    check = getattr(model_cls, "check_tensor_parallel_size", None)
    if check is not None:
        check(spec.hf_config, tp)


@hookimpl
def register_executors(register):
    register("multiproc", MultiprocExecutor)
