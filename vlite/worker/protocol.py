"""What the ``multiproc`` executor and its worker processes say to each other.

Every message is a tagged msgspec struct, msgpack-encoded, one per
``Connection.send_bytes``. The only exception is the first message to a worker, the
pickled :class:`WorkerBootstrap` (it carries the configuration and the plugin registry's
classes, which msgpack cannot express). The conversation:

1. engine -> worker: ``WorkerBootstrap``; worker -> engine: :class:`ModelLoaded`.
2. engine -> worker: :class:`InitializeKVCache`; worker -> engine: :class:`KVCacheReady`.
3. per step, engine -> every worker: :class:`ExecuteStep`; rank 0 -> engine:
   :class:`StepResult` (the other ranks computed the same tokens and say nothing).
4. engine -> worker: :class:`Shutdown`; the worker leaves its process group and exits.

A worker that fails sends :class:`WorkerFailure` and exits; one that finds its connection
closed (the engine is gone) exits too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from vlite.core.config import VliteConfig
from vlite.core.outputs import ModelRunnerOutput, SchedulerOutput


@dataclass(frozen=True)
class WorkerBootstrap:
    """Everything a worker process needs to build its model shard.

    Attributes:
        config: the engine configuration.
        registry: the engine's :class:`~vlite.core.plugins.PluginRegistry`, so workers use
            the very plugin classes the engine was given (including ones registered in code).
        rank: this worker's tensor-parallel rank.
        world_size: the tensor-parallel size.
        init_method: where the ranks meet (``torch.distributed`` init method).
        num_threads: torch's intra-op threads for this worker.
        sys_path: the engine process's ``sys.path``, so plugin classes import the same way.
    """

    config: VliteConfig
    registry: Any
    rank: int
    world_size: int
    init_method: str
    num_threads: int
    sys_path: list[str]


# ---- engine -> worker ---------------------------------------------------------------------


class InitializeKVCache(msgspec.Struct, tag=True, array_like=True):
    num_blocks: int


class ExecuteStep(msgspec.Struct, tag=True, array_like=True):
    """Run the forward pass and sample (``Executor.execute_model`` + ``sample_tokens``)."""

    scheduler_output: SchedulerOutput


class Shutdown(msgspec.Struct, tag=True, array_like=True):
    pass


ToWorker = InitializeKVCache | ExecuteStep | Shutdown


# ---- worker -> engine ---------------------------------------------------------------------


class ModelLoaded(msgspec.Struct, tag=True, array_like=True):
    """The shard is loaded; how many KV blocks this rank's memory budget holds, and what
    its weights and one of its KV-cache blocks take (bytes)."""

    num_kv_blocks: int
    attention_backend_name: str
    weights_bytes: int = 0
    kv_cache_block_bytes: int = 0


class KVCacheReady(msgspec.Struct, tag=True, array_like=True):
    pass


class StepResult(msgspec.Struct, tag=True, array_like=True):
    output: ModelRunnerOutput


class WorkerFailure(msgspec.Struct, tag=True, array_like=True):
    """An exception in a worker: its type, message and formatted traceback."""

    rank: int
    error_type: str
    message: str
    traceback: str


FromWorker = ModelLoaded | KVCacheReady | StepResult | WorkerFailure
