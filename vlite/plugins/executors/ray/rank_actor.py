"""The code inside each rank's Ray actor: the same ``Worker`` as ``multiproc``'s processes.

:class:`RankWorker` is a plain class; the executor makes it an actor class with
``ray.remote`` (so importing this module never imports Ray). The conversation, every call
made on every rank:

1. :meth:`~RankWorker.location` (where the actor runs), and on rank 0
   :meth:`~RankWorker.free_port` (for the ``torch.distributed`` rendezvous);
2. :meth:`~RankWorker.load`: join the process group, load this rank's shard, report the
   KV-cache budget (``vlite.worker.worker_process.build_worker`` and ``report_loaded``);
3. :meth:`~RankWorker.initialize_kv_cache`;
4. per step :meth:`~RankWorker.execute_step`: forward pass and sampling; the rank whose
   role returns output sends the msgpack-encoded ``ModelRunnerOutput``, the others
   ``None``.

Exceptions travel back through Ray, which names the actor's traceback.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import msgspec

from vlite.core.outputs import ModelRunnerOutput, SchedulerOutput
from vlite.distributed.process_group import free_tcp_port
from vlite.plugins.executors.ray.layout import RankRole
from vlite.worker.protocol import ModelLoaded


@dataclass(frozen=True)
class RankLocation:
    """Where a rank's actor runs: its node's IP address and Ray node id, and its pid."""

    node_ip: str
    node_id: str
    pid: int

    def describe(self) -> str:
        return f"Ray actor pid {self.pid} on node {self.node_ip}, node id {self.node_id}"


class RankWorker:
    """One rank: a :class:`~vlite.worker.worker.Worker` and its role.

    Args:
        role: what this rank does (see :mod:`vlite.plugins.executors.ray.layout`).
    """

    def __init__(self, role: RankRole) -> None:
        self.role = role
        self.worker = None
        self._decoder = msgspec.msgpack.Decoder(SchedulerOutput)
        self._encoder = msgspec.msgpack.Encoder()

    def location(self) -> RankLocation:
        import ray

        node_id = ray.get_runtime_context().get_node_id()
        return RankLocation(ray.util.get_node_ip_address(), node_id, os.getpid())

    def free_port(self) -> int:
        """A free TCP port on this actor's node, for rank 0 to listen on."""
        return free_tcp_port()

    def load(self, bootstrap_payload: bytes) -> ModelLoaded:
        """Join the process group and load the shard; ``bootstrap_payload`` is packed as
        ``vlite.worker.worker_process.unpack_bootstrap`` expects."""
        from vlite.worker.worker_process import build_worker, report_loaded, unpack_bootstrap

        self.worker = build_worker(unpack_bootstrap(bootstrap_payload))
        return report_loaded(self.worker)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self._loaded().initialize_kv_cache(num_blocks)

    def execute_step(self, scheduler_output: bytes) -> bytes | None:
        """Run one step; the encoded output if this rank returns it, else ``None``."""
        worker = self._loaded()
        worker.execute_model(self._decoder.decode(scheduler_output))
        output: ModelRunnerOutput = worker.sample_tokens()
        return self._encoder.encode(output) if self.role.returns_output else None

    def _loaded(self):
        if self.worker is None:
            raise RuntimeError(f"rank {self.role.rank}: load() must run before the worker is used")
        return self.worker
