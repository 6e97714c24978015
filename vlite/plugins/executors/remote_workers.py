"""RemoteWorkersExecutor: the base of executors whose ranks run outside the engine's process.

``multiproc`` (worker processes) and ``ray`` (Ray actors) start their ranks, wait for every
rank to load its shard, and then size the KV cache, report memory and shut down the same
way; only how they start ranks and carry a step differs. A subclass builds its ranks (an
object with ``stop()`` and ``initialize_kv_cache(num_blocks)``) and hands them to
:meth:`RemoteWorkersExecutor.adopt_ranks` with the call that waits for them to load.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import msgspec

from vlite.core.executor import Executor
from vlite.core.memory import WorkerMemory
from vlite.worker.protocol import ModelLoaded


class Ranks(Protocol):
    """What the base needs of a subclass's ranks."""

    def stop(self) -> None:
        """Stop every rank (idempotent)."""

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate ``num_blocks`` KV-cache blocks on every rank."""


class RemoteWorkersExecutor(Executor):
    """Ranks in other processes or on other nodes: loaded at construction, stopped by
    :meth:`shutdown` (also when the executor is garbage-collected or the interpreter
    exits)."""

    runs_workers_in_subprocesses = True
    supports_tensor_parallel = True

    def adopt_ranks(self, ranks: Ranks, load: Callable[[], Sequence[ModelLoaded]]) -> None:
        """Take ``ranks``, wait for ``load()`` (every rank's reply once its shard is
        loaded) and keep what the replies report; stop the ranks if loading fails."""
        self.ranks: Any = ranks
        self._finalizer = weakref.finalize(self, ranks.stop)
        try:
            loaded = load()
        except BaseException:
            self.shutdown()
            raise
        self.attention_backend_name = loaded[0].attention_backend_name
        self._num_kv_blocks_per_rank = [reply.num_kv_blocks for reply in loaded]
        self.worker_memory = tuple(
            WorkerMemory(reply.weights_bytes, reply.kv_cache_block_bytes) for reply in loaded
        )
        self._encoder = msgspec.msgpack.Encoder()

    def initialize_kv_cache(self) -> int:
        """The smallest count any rank can hold, allocated on every rank."""
        num_blocks = min(self._num_kv_blocks_per_rank)
        self.ranks.initialize_kv_cache(num_blocks)
        return num_blocks

    @property
    def max_concurrent_batches(self) -> int:
        """One batch per pipeline stage."""
        return self.config.pipeline_parallel_size

    def shutdown(self) -> None:
        self._finalizer()
