"""A GGUF file's matrix products in forward order, as a step makes them.

``benchmarks/quantized_activations.py`` times one product again and again, so its weights
stay in the cache; a decode step reads each weight once, from memory, one product after
another. This calls every 2-D quantized or 16-bit tensor of ``--model`` in the file's order
(the layers' order) through ``GGUFBlockKernels.product``, each with ``--rows`` rows of
random activations, ``--rounds`` times per row count, and prints the best pass: its total
milliseconds, the weights it streamed per second, and the time per kind of tensor
(``attn_q``, ``ffn_down``, ``token_embd`` for a tied LM head, ...). The activations mode
(``--activations``) is the engine's setting; at ``int16`` on a CPU with AVX-512 VNNI the
library itself picks the tiles or the int16 GEMM by row count (``int16_gemm_rows``).

    python benchmarks/model_products.py --model SmolLM2-135M-Instruct.Q4_1.gguf --rows 1 8 16 31
    python benchmarks/model_products.py --model llama-1b-Q4_K_M.gguf --rows 4 8 12 16 --threads 2

Run it on a quiet machine; to compare two builds of the kernels, run it once per build.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import gguf
import torch

from vlite.kernels.native import ACTIVATION_BITS, BLOCK_LAYOUTS, gguf_block_kernels


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True, help="a GGUF file")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16], help="rows of x")
    parser.add_argument("--activations", default="int16", choices=sorted(ACTIVATION_BITS))
    parser.add_argument("--rounds", type=int, default=4, help="passes per row count")
    parser.add_argument("--threads", type=int, default=2)
    return parser.parse_args()


def file_products(path: Path, activations: str) -> list[tuple[str, int, int, Callable]]:
    """``(kind, in_features, bytes, product)`` for each tensor the kernels multiply, in the
    file's order."""
    kernels = gguf_block_kernels()
    products = []
    for tensor in gguf.GGUFReader(str(path)).tensors:
        qtype = tensor.tensor_type.name
        if len(tensor.shape) != 2 or qtype not in BLOCK_LAYOUTS:
            continue
        blocks = torch.frombuffer(bytearray(tensor.data.tobytes()), dtype=torch.uint8)
        out_features, in_features = int(tensor.shape[1]), int(tensor.shape[0])
        blocks = blocks.reshape(out_features, -1)
        product = kernels.product(qtype, blocks, out_features, in_features, activations)
        kind = tensor.name.split(".")[-2]
        products.append((kind, in_features, blocks.numel(), product))
    return products


def best_pass(products: list, num_rows: int, rounds: int) -> tuple[float, dict[str, float]]:
    """The fastest of ``rounds`` passes over every product: its seconds, and per kind."""
    inputs = {k: torch.randn(num_rows, k) for k in {p[1] for p in products}}
    best, best_kinds = float("inf"), {}
    for _ in range(rounds):
        kinds: dict[str, float] = defaultdict(float)
        start = time.perf_counter()
        for kind, in_features, _, product in products:
            began = time.perf_counter()
            product(inputs[in_features])
            kinds[kind] += time.perf_counter() - began
        seconds = time.perf_counter() - start
        if seconds < best:
            best, best_kinds = seconds, dict(kinds)
    return best, best_kinds


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    products = file_products(args.model, args.activations)
    if not products:
        raise SystemExit(f"{args.model}: no tensor the kernels multiply")
    weight_bytes = sum(p[2] for p in products)
    print(
        f"{args.model.name}: {len(products)} products, {weight_bytes / 2**20:.0f} MiB of "
        f"weights; activations {args.activations}, {args.threads} threads, best of "
        f"{args.rounds} passes"
    )
    for num_rows in args.rows:
        seconds, kinds = best_pass(products, num_rows, args.rounds)
        by_kind = " ".join(f"{kind} {s * 1e3:.2f}" for kind, s in kinds.items())
        print(
            f"rows {num_rows:4d}: {seconds * 1e3:8.2f} ms, {weight_bytes / seconds / 1e9:5.1f} "
            f"GB/s of weights  ({by_kind} ms)"
        )


if __name__ == "__main__":
    main()
