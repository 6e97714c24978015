"""A decode step's attention on the CPU over a float32 and a float16 KV cache, alternated.

``--seqs`` sequences of ``--context`` tokens each decode one token through ``--layers``
layers of the C kernel (the ``cpu`` backend's ``paged_attention.c``), every layer with its
own cache (so the contexts come from memory, as in a model), blocks of 16 scattered over the
cache as a long-running engine leaves them. The two cache dtypes take turns call by call,
``--repeats`` times each; prints the CPU, then per dtype the best and median time of a
step's attention (all layers) and the cache bytes it reads per second. The default shape is
SmolLM2-135M's (9 query and 3 KV heads of 64, 30 layers) at the batched workload's size.

    python benchmarks/cpu_attention.py                          # 32 sequences of 200 tokens
    python benchmarks/cpu_attention.py --seqs 1 --context 4096   # one long stream

``--baseline FILE`` also builds another ``paged_attention.c`` (the headers beside it must
be there too; e.g. ``git show REV:vlite/kernels/paged_attention.c``) with the same flags and
alternates it with today's kernel, for an A/B of a kernel change.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from quantized_activations import describe_cpu  # benchmarks/: its folder is on sys.path

from vlite.kernels import native

BLOCK_SIZE = 16


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seqs", type=int, default=32, help="sequences in the decode step")
    parser.add_argument("--context", type=int, default=200, help="tokens each one attends to")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--heads", type=int, default=9, help="query heads")
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--baseline", type=Path, help="another paged_attention.c to compare")
    return parser.parse_args()


def decode_step(args: argparse.Namespace, kernel, dtype: torch.dtype, seed: int):
    """``run()``: one decode step's attention over ``--layers`` caches of ``dtype``."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = -(-(args.context + 1) // BLOCK_SIZE)
    num_blocks = args.seqs * blocks_per_seq
    tables = torch.randperm(num_blocks, generator=gen).int().view(args.seqs, blocks_per_seq)
    shape = (2, num_blocks, BLOCK_SIZE, args.kv_heads, args.head_dim)
    caches = [torch.randn(shape, generator=gen).to(dtype) for _ in range(args.layers)]
    position = args.context  # the new token's; it sees context + 1 keys
    slots = tables[:, position // BLOCK_SIZE].long() * BLOCK_SIZE + position % BLOCK_SIZE
    step = kernel.step(
        slots,
        tables.contiguous(),
        torch.full((args.seqs,), position + 1, dtype=torch.int32),
        torch.arange(args.seqs + 1, dtype=torch.int32),
        args.head_dim**-0.5,
    )
    query = torch.randn(args.seqs, args.heads, args.head_dim, generator=gen)
    key = torch.randn(args.seqs, args.kv_heads, args.head_dim, generator=gen)
    value = torch.randn(args.seqs, args.kv_heads, args.head_dim, generator=gen)

    def run() -> None:
        for cache in caches:
            step(query, key, value, cache)

    return run


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)  # the kernels read torch's thread count
    kernels = {"": native.paged_attention_kernel()}
    if args.baseline is not None:
        library = native.build_library(args.baseline.resolve(), native.FLAGS)
        kernels = {"baseline ": native.PagedAttentionKernel(library), "today's ": kernels[""]}
    dtypes = {"float32": torch.float32, "float16": torch.float16}
    runs = {
        f"{label}{name}": (dtype, decode_step(args, kernel, dtype, seed=1))
        for name, dtype in dtypes.items()
        for label, kernel in kernels.items()
    }
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _, run in runs.values():
        run()  # warm-up (and the kernel's build)
    for _ in range(args.repeats):
        for name, (_, run) in runs.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    print(f"CPU: {describe_cpu()}; {args.threads} threads")
    print(
        f"{args.seqs} sequences x {args.context + 1} keys, {args.layers} layers of {args.heads} "
        f"query / {args.kv_heads} KV heads of {args.head_dim}; best and median of "
        f"{args.repeats}, alternated"
    )
    print("| cache | best ms | median ms | cache read | best GB/s |")
    print("|---|---:|---:|---:|---:|")
    keys = args.seqs * (args.context + 1) * args.layers
    for name, (dtype, _) in runs.items():
        read = 2 * keys * args.kv_heads * args.head_dim * dtype.itemsize
        best, median = min(times[name]), statistics.median(times[name])
        print(
            f"| {name} | {best * 1e3:.2f} | {median * 1e3:.2f} | {read / 2**20:.0f} MiB | "
            f"{read / best / 1e9:.1f} |"
        )


if __name__ == "__main__":
    main()
