"""``uniproc``: one worker in the engine's own process.

With ``async_scheduling`` the worker runs each batch on one background thread, so the
engine schedules the next batch while the current one computes (PyTorch releases the
GIL inside its kernels); batches still run one at a time, in submission order.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

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
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            if getattr(config, name) != 1:
                raise ValueError(
                    f"executor 'uniproc' runs one worker; {name}={getattr(config, name)} needs "
                    "a multi-process executor ('multiproc' or 'ray')"
                )
        self.worker = Worker(config, registry)
        self.worker.load_model()
        self.attention_backend_name = self.worker.attention_backend_name
        self.worker_memory = (self.worker.memory_report(),)
        self._thread: ThreadPoolExecutor | None = None
        if config.async_scheduling:
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="vlite-uniproc-worker")

    def initialize_kv_cache(self) -> int:
        num_blocks = self.worker.determine_num_kv_blocks()
        self.worker.initialize_kv_cache(num_blocks)
        return num_blocks

    def execute_model(self, scheduler_output: SchedulerOutput) -> None:
        self.worker.execute_model(scheduler_output)

    def sample_tokens(self) -> ModelRunnerOutput:
        return self.worker.sample_tokens()

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> Future[ModelRunnerOutput]:
        """On the worker thread with ``async_scheduling``, else at once."""
        if self._thread is None:
            return super().execute_model_async(scheduler_output)
        return self._thread.submit(self._run_batch, scheduler_output)

    def _run_batch(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self.worker.execute_model(scheduler_output)
        return self.worker.sample_tokens()

    def shutdown(self) -> None:
        if self._thread is not None:
            self._thread.shutdown(wait=True)
            self._thread = None


@hookimpl
def register_executors(register):
    register("uniproc", UniprocExecutor)
