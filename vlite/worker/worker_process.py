"""The main loop of one ``multiproc`` worker process (``python -m vlite.worker.worker_process FD``).

``FD`` is this end of a socket pair to the engine process. The worker reads its
:class:`~vlite.worker.protocol.WorkerBootstrap`, joins the tensor-parallel process group,
loads its model shard, then serves the engine's messages until told to shut down or until
the engine's end of the socket closes. Any exception is reported as a
:class:`~vlite.worker.protocol.WorkerFailure` before the process exits.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import sys
import traceback
from multiprocessing.connection import Connection

import msgspec

from vlite.worker.protocol import (
    ExecuteStep,
    InitializeKVCache,
    KVCacheReady,
    ModelLoaded,
    Shutdown,
    StepResult,
    ToWorker,
    WorkerBootstrap,
    WorkerFailure,
)

#: Exit status of a worker that reported a failure.
FAILURE_EXIT_CODE = 1


def read_bootstrap(conn: Connection) -> WorkerBootstrap:
    """The first message: ``(sys_path, pickled bootstrap)``; ``sys.path`` is set first so the
    registry's plugin classes unpickle from the same modules as in the engine process."""
    sys_path, payload = pickle.loads(conn.recv_bytes())
    sys.path[:] = [*sys_path, *(entry for entry in sys.path if entry not in sys_path)]
    return pickle.loads(payload)


def build_worker(bootstrap: WorkerBootstrap):
    """Set threads, join the process group and load this rank's shard."""
    import torch

    from vlite.distributed import init_tensor_parallel_group
    from vlite.worker.worker import Worker

    torch.set_num_threads(bootstrap.num_threads)
    device = bootstrap.config.torch_device
    if device.type == "cuda":
        device = torch.device("cuda", bootstrap.rank % torch.cuda.device_count())
    group = init_tensor_parallel_group(
        bootstrap.rank, bootstrap.world_size, bootstrap.init_method, device
    )
    worker = Worker(bootstrap.config, bootstrap.registry, tp_group=group, device=device)
    worker.load_model()
    return worker


def serve(conn: Connection, worker, rank: int) -> None:
    """Answer the engine's messages until :class:`Shutdown` or a closed connection."""
    encoder = msgspec.msgpack.Encoder()
    decoder = msgspec.msgpack.Decoder(ToWorker)
    while True:
        try:
            data = conn.recv_bytes()
        except (EOFError, OSError):
            return  # the engine process is gone
        match decoder.decode(data):
            case ExecuteStep(scheduler_output):
                worker.execute_model(scheduler_output)
                output = worker.sample_tokens()
                if rank == 0:
                    conn.send_bytes(encoder.encode(StepResult(output)))
            case InitializeKVCache(num_blocks):
                worker.initialize_kv_cache(num_blocks)
                conn.send_bytes(encoder.encode(KVCacheReady()))
            case Shutdown():
                return


def run(conn: Connection) -> int:
    """Bootstrap, load, serve; the process's exit status."""
    rank = -1
    worker = None
    try:
        bootstrap = read_bootstrap(conn)
        rank = bootstrap.rank
        worker = build_worker(bootstrap)
        num_blocks = worker.determine_num_kv_blocks()
        loaded = ModelLoaded(num_blocks, worker.attention_backend_name or "")
        conn.send_bytes(msgspec.msgpack.encode(loaded))
        serve(conn, worker, rank)
    except BaseException as exc:  # reported to the engine, which raises it there
        failure = WorkerFailure(rank, type(exc).__name__, str(exc), traceback.format_exc())
        with contextlib.suppress(OSError):  # the engine is gone: nobody to tell
            conn.send_bytes(msgspec.msgpack.encode(failure))
        return FAILURE_EXIT_CODE
    from vlite.distributed import destroy_tensor_parallel_group

    destroy_tensor_parallel_group(worker.tp_group)
    return 0


def main() -> None:
    # Ctrl-C reaches the whole terminal process group: the engine handles it and shuts
    # the workers down (or they see its connection close), so they ignore it themselves.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    conn = Connection(int(sys.argv[1]))
    status = run(conn)
    conn.close()
    sys.stdout.flush()
    # Skip interpreter teardown: torch's and gloo's threads can make it slow or noisy.
    os._exit(status)


if __name__ == "__main__":
    main()
