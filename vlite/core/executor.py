"""The executor interface: the engine core's handle on compute (``register_executors``)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from concurrent.futures import Future

from vlite.core.config import VliteConfig
from vlite.core.memory import WorkerMemory
from vlite.core.outputs import ModelRunnerOutput, SchedulerOutput
from vlite.core.plugins import PluginRegistry


class Executor(ABC):
    """Fans each step out to the worker(s) that own the model and the KV cache.

    Constructed as ``cls(config, registry)`` in the engine-core process. The engine calls
    :meth:`initialize_kv_cache` once, then per step :meth:`execute_model` followed by
    :meth:`sample_tokens`, and :meth:`shutdown` at the end.
    """

    # Capability flags, read by the conformance suite (vlite.testing.ExecutorConformance):
    #: Whether workers run in child processes (a worker process dying must become an error).
    runs_workers_in_subprocesses: bool = False
    #: Whether ``tensor_parallel_size > 1`` is supported.
    supports_tensor_parallel: bool = False
    #: Whether greedy and seeded requests give the same tokens as ``uniproc``.
    is_deterministic: bool = True

    def __init__(self, config: VliteConfig, registry: PluginRegistry) -> None:
        self.config = config
        self.registry = registry
        #: The registered name of the attention backend the workers built. Set by the
        #: constructor once the workers have loaded the model. The engine resolves
        #: ``"auto"`` before it builds the executor (:mod:`vlite.core.verify`), so the
        #: ``config`` an executor gets already names the backend, and the engine reports
        #: and checks that one. ``None``: not reported.
        self.attention_backend_name: str | None = None
        #: What each worker holds (its weights, one KV-cache block), set by the constructor
        #: once the workers have loaded the model; the engine core adds them up into its
        #: :class:`~vlite.core.memory.MemoryPlan`. Empty: not reported (no plan).
        self.worker_memory: tuple[WorkerMemory, ...] = ()

    @abstractmethod
    def initialize_kv_cache(self) -> int:
        """Allocate every worker's KV cache; return the number of blocks (same on all)."""

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> None:
        """Run the forward pass for the scheduled batch."""

    @abstractmethod
    def sample_tokens(self) -> ModelRunnerOutput:
        """Sample from the last forward pass's logits."""

    @property
    def max_concurrent_batches(self) -> int:
        """How many batches the executor works on at once (a pipeline of ``N`` stages:
        ``N``). Above 1 the engine keeps a queue of batches in flight."""
        return 1

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> Future[ModelRunnerOutput]:
        """Submit a batch; the future resolves to its :class:`ModelRunnerOutput`.

        Batches complete in submission order. The default runs :meth:`execute_model` and
        :meth:`sample_tokens` at once; an executor whose workers run on their own (other
        processes or actors) returns before the batch is done.
        """
        self.execute_model(scheduler_output)
        future: Future[ModelRunnerOutput] = Future()
        future.set_result(self.sample_tokens())
        return future

    def shutdown(self) -> None:
        """Release workers and their resources. Calling it twice is harmless."""
        return None
