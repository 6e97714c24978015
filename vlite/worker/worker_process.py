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
    """The first message, unpacked by :func:`unpack_bootstrap`."""
    return unpack_bootstrap(conn.recv_bytes())


def unpack_bootstrap(data: bytes) -> WorkerBootstrap:
    """``data`` is ``(sys_path, pickled bootstrap)``, pickled; ``sys.path`` is set first so
    the registry's plugin classes unpickle from the same modules as in the engine process.
    (Every executor whose workers live in other processes hands them their bootstrap so.)"""
    sys_path, payload = pickle.loads(data)
    sys.path[:] = [*sys_path, *(entry for entry in sys.path if entry not in sys_path)]
    return pickle.loads(payload)


def build_worker(bootstrap: WorkerBootstrap):
    """Set threads, join the process groups and load this rank's shard (its pipeline
    stage's layers, its tensor-parallel slice of them)."""
    import torch

    from vlite.distributed import init_tensor_parallel_group
    from vlite.distributed.pipeline import build_parallel_groups
    from vlite.worker.worker import Worker

    config = bootstrap.config
    torch.set_num_threads(bootstrap.num_threads)
    device = config.torch_device
    if device.type == "cuda":
        device = torch.device("cuda", bootstrap.rank % torch.cuda.device_count())
    # The default group spans every rank; the stages' tensor-parallel groups live in it.
    init_tensor_parallel_group(bootstrap.rank, bootstrap.world_size, bootstrap.init_method, device)
    tp_group, pp_group = build_parallel_groups(
        bootstrap.rank,
        config.tensor_parallel_size,
        config.pipeline_parallel_size,
        config.pp_layer_partition,
    )
    worker = Worker(config, bootstrap.registry, tp_group=tp_group, pp_group=pp_group, device=device)
    worker.load_model()
    return worker


def report_loaded(worker) -> ModelLoaded:
    """What a loaded worker tells its executor: its KV-block budget, attention backend,
    and the bytes of its weights and of one KV-cache block."""
    memory = worker.memory_report()
    return ModelLoaded(
        worker.determine_num_kv_blocks(),
        worker.attention_backend_name or "",
        memory.weights_bytes,
        memory.kv_cache_block_bytes,
    )


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
                if worker.reports_samples:
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
        conn.send_bytes(msgspec.msgpack.encode(report_loaded(worker)))
        serve(conn, worker, rank)
    except BaseException as exc:  # reported to the engine, which raises it there
        failure = WorkerFailure(rank, type(exc).__name__, str(exc), traceback.format_exc())
        with contextlib.suppress(OSError):  # the engine is gone: nobody to tell
            conn.send_bytes(msgspec.msgpack.encode(failure))
        return FAILURE_EXIT_CODE
    import torch.distributed as dist

    if dist.is_initialized():  # every rank's default group, whatever its stage and slice
        dist.destroy_process_group()
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
