"""``uniproc``: one worker in the engine's own process."""

from __future__ import annotations

from vlite.core.config import VliteConfig
from vlite.core.executor import Executor
from vlite.core.hookspecs import hookimpl
from vlite.core.outputs import ModelRunnerOutput, SchedulerOutput
from vlite.core.plugins import PluginRegistry
from vlite.worker.worker import Worker


class UniprocExecutor(Executor):
    """Calls a single in-process :class:`~vlite.worker.worker.Worker` directly."""

    def __init__(self, config: VliteConfig, registry: PluginRegistry) -> None:
        super().__init__(config, registry)
        if config.tensor_parallel_size != 1:
            raise ValueError(
                f"executor 'uniproc' runs one worker; tensor_parallel_size="
                f"{config.tensor_parallel_size} needs a multi-process executor"
            )
        self.worker = Worker(config, registry)
        self.worker.load_model()
        self.attention_backend_name = self.worker.attention_backend_name

    def initialize_kv_cache(self) -> int:
        num_blocks = self.worker.determine_num_kv_blocks()
        self.worker.initialize_kv_cache(num_blocks)
        return num_blocks

    def execute_model(self, scheduler_output: SchedulerOutput) -> None:
        self.worker.execute_model(scheduler_output)

    def sample_tokens(self) -> ModelRunnerOutput:
        return self.worker.sample_tokens()


@hookimpl
def register_executors(register):
    register("uniproc", UniprocExecutor)
