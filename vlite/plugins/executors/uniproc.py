"""``uniproc``: one worker in the engine's own process.

With ``async_scheduling`` a batch is submitted on the engine's own thread and its sampled
tokens stay on the device until the engine reads them
(:mod:`vlite.worker.sampled_tokens`): on CUDA the engine schedules and launches the next
batch, which reads those tokens on the device, while this one computes, with no second
thread to contend for the GIL; on the CPU, where the forward computes as it is called, the
batches simply run in turn.
"""

from __future__ import annotations

from concurrent.futures import Future

from vlite.core.config import VliteConfig
from vlite.core.errors import ConfigError
from vlite.core.executor import Executor
from vlite.core.hookspecs import hookimpl
from vlite.core.outputs import ModelRunnerOutput, SchedulerOutput
from vlite.core.plugins import PluginRegistry
from vlite.worker.worker import Worker


class UniprocExecutor(Executor):
    """Calls a single in-process :class:`~vlite.worker.worker.Worker` directly."""

    def __init__(self, config: VliteConfig, registry: PluginRegistry) -> None:
        super().__init__(config, registry)
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            if getattr(config, name) != 1:
                raise ConfigError(
                    f"executor 'uniproc' runs one worker; {name}={getattr(config, name)} needs "
                    "a multi-process executor ('multiproc' or 'ray')"
                )
        self.worker = Worker(config, registry)
        self.worker.load_model()
        self.attention_backend_name = self.worker.attention_backend_name
        self.worker_memory = (self.worker.memory_report(),)

    def initialize_kv_cache(self) -> int:
        num_blocks = self.worker.determine_num_kv_blocks()
        self.worker.initialize_kv_cache(num_blocks)
        return num_blocks

    def execute_model(self, scheduler_output: SchedulerOutput) -> None:
        self.worker.execute_model(scheduler_output)

    def sample_tokens(self) -> ModelRunnerOutput:
        return self.worker.sample_tokens()

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> Future[ModelRunnerOutput]:
        """Run the batch and sample; the future's ``result()`` brings its tokens to the host."""
        self.worker.execute_model(scheduler_output)
        return self.worker.sample_tokens_deferred()


@hookimpl
def register_executors(register):
    register("uniproc", UniprocExecutor)
