"""The executor interface: the engine core's handle on compute (``register_executors``)."""

from __future__ import annotations

from abc import ABC, abstractmethod

from vlite.core.config import VliteConfig
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
        #: The registered name of the attention backend the workers built (what
        #: ``config.attention_backend``, e.g. ``"auto"``, resolved to there). Set by the
        #: constructor once the workers have loaded the model; the engine reports it and
        #: checks its capabilities. ``None``: not reported (the engine uses the config's).
        self.attention_backend_name: str | None = None

    @abstractmethod
    def initialize_kv_cache(self) -> int:
        """Allocate every worker's KV cache; return the number of blocks (same on all)."""

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> None:
        """Run the forward pass for the scheduled batch."""

    @abstractmethod
    def sample_tokens(self) -> ModelRunnerOutput:
        """Sample from the last forward pass's logits."""

    def shutdown(self) -> None:
        """Release workers and their resources. Calling it twice is harmless."""
        return None
