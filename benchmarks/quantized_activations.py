"""Products per GGUF type: float32 activations against int8 and int16, at any row count.

For each quantized type the C kernels take, a random matrix of that type (``--shape N K``,
default 2048 x 1536) multiplied by ``--rows`` rows of random activations through
``GGUFBlockKernels.product`` with ``activations`` ``"float32"``, ``"int8"`` and ``"int16"``:
the three alternate call by call, ``--repeats`` times each, and the best time
and median of each are kept. Prints the CPU (``lscpu``'s model name and its vector and
matrix flags) and three limits measured on it with the same threads: PyTorch's float32 GEMM
and bfloat16 GEMM (up to 2048^3; the bf16 one runs on the 16-bit dot-product unit the int16
kernels use, ``vdpbf16ps`` beside ``vpdpwssd``, where the CPU has AVX-512 BF16) and a
streaming read of 256 MiB; then one row per type and row count: the best times, each
quantized mode's speed against float32, best (median), and each mode's GFLOP/s as a share
of its unit's measured peak (float32 of the float32 GEMM's, int8 and int16 of the bf16
GEMM's where that is the faster, else of the float32 GEMM's: see :func:`peak_of`). Decode
sizes (1, 8 rows) show the memory-bound products ``quantized_activations=auto`` was chosen
from (README, "Quantized activations"); prefill sizes (64, 512 rows) the compute-bound
ones, how far each path runs from its unit's limit. Run it on a quiet machine.

    python benchmarks/quantized_activations.py                     # 1 and 8 rows, 2 threads
    python benchmarks/quantized_activations.py --rows 64 512 --shape 8192 2048 --repeats 5
    python benchmarks/quantized_activations.py --rows 1 --types Q4_K Q6_K --threads 1
"""

from __future__ import annotations

import argparse
import functools
import platform
import statistics
import subprocess
import time

import numpy as np
import torch

from vlite.kernels.native import BLOCK_LAYOUTS, gguf_block_kernels
from vlite.testing.tiny_gguf import random_quantized_matrix

QUANTIZED_TYPES = sorted(set(BLOCK_LAYOUTS) - {"F16", "BF16"})
MODES = ("float32", "int8", "int16")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--types", nargs="+", default=QUANTIZED_TYPES, choices=QUANTIZED_TYPES)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8], help="rows of x")
    parser.add_argument("--shape", type=int, nargs=2, default=[2048, 1536], metavar=("N", "K"))
    parser.add_argument("--repeats", type=int, default=50, help="calls per mode (best kept)")
    parser.add_argument("--threads", type=int, default=2)
    return parser.parse_args()


def call_times(products: dict, x: torch.Tensor, repeats: int) -> dict[str, list[float]]:
    """Each product's wall times over ``repeats`` calls, the modes alternating."""
    times: dict[str, list[float]] = {mode: [] for mode in products}
    for product in products.values():
        product(x)  # warm-up
    for _ in range(repeats):
        for mode, product in products.items():
            start = time.perf_counter()
            product(x)
            times[mode].append(time.perf_counter() - start)
    return times


#: The CPU flags that decide which kernels run (vector width, integer and bf16 dot products,
#: matrix tiles).
KERNEL_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16",
                "avx_vnni", "amx_tile", "amx_int8", "amx_bf16")  # fmt: skip


def describe_cpu() -> str:
    """``lscpu``'s model name and which of :data:`KERNEL_FLAGS` the CPU has."""
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return platform.processor() or platform.machine()
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    flags = set(fields.get("Flags", "").split())
    name = fields.get("Model name", platform.machine()).strip()
    return f"{name}; flags: {' '.join(f for f in KERNEL_FLAGS if f in flags) or 'none of note'}"


def best_seconds(run, repeats: int = 5) -> float:
    run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times)


def gemm_gflops(dtype: torch.dtype) -> float:
    """GFLOP/s of PyTorch's GEMM in ``dtype`` with the current threads: square, 512 to
    2048 on a side, the largest whose call takes under 0.1 s at the smaller size's rate (a
    CPU without bfloat16 units runs it emulated at a few GFLOP/s: 2048^3 would take
    minutes)."""
    size, seconds = 512, 0.0
    while True:
        a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
        seconds = best_seconds(functools.partial(torch.mm, a, b), repeats=3)
        if size == 2048 or seconds * 8 > 0.1:
            return 2 * size**3 / seconds / 1e9
        size *= 2


def measured_limits() -> dict[str, float]:
    """GFLOP/s of PyTorch's float32 and bfloat16 GEMMs and the streaming read's GB/s, with
    the current threads: ``{"float32": ..., "bfloat16": ..., "read": ...}``."""
    limits = {
        name: gemm_gflops(dtype)
        for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16))
    }
    big = torch.ones(64 << 20)
    limits["read"] = big.nbytes / best_seconds(big.sum) / 1e9
    return limits


def peak_of(limits: dict[str, float]) -> dict[str, str]:
    """Which measured peak each mode's GFLOP/s is a share of: its multiply unit's, the
    bfloat16 GEMM's for the integer modes where it beats float32's (AVX-512 BF16 or AMX:
    the 16-bit dot-product unit), else float32's (without them bfloat16 is emulated and
    ``vpmaddwd`` runs at most at the FMA units' rate)."""
    integer = "bfloat16" if limits["bfloat16"] > limits["float32"] else "float32"
    return {"float32": "float32", "int8": integer, "int16": integer}


def ratio(best: dict[str, float], median: dict[str, float], mode: str) -> str:
    """``mode``'s speed against float32: ``"1.40x (1.35x)"``, best (median)."""
    return f"{best['float32'] / best[mode]:.2f}x ({median['float32'] / median[mode]:.2f}x)"


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    kernels = gguf_block_kernels()
    rows, cols = args.shape
    limits = measured_limits()
    print(f"{describe_cpu()}; {args.threads} threads; {rows} x {cols}")
    print(
        f"measured: float32 GEMM {limits['float32']:.0f} GFLOP/s, bfloat16 GEMM "
        f"{limits['bfloat16']:.0f} GFLOP/s (torch.mm, up to 2048^3), streaming read "
        f"{limits['read']:.1f} GB/s (sum of 256 MiB)"
    )
    peaks = peak_of(limits)
    print(f"integer modes' share: of the {peaks['int16']} GEMM's peak")
    print(
        "| type | rows | float32 µs | int8 µs | int16 µs | int8 / float32 best (median) "
        "| int16 / float32 best (median) | GFLOP/s float32, int8, int16 (of the unit's peak) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    rng = np.random.default_rng(0)
    for qtype in args.types:
        if not kernels.has_quantized_activations(qtype):
            print(f"| {qtype} | — | no integer kernels in this build (needs AVX2) |")
            continue
        blocks = torch.from_numpy(random_quantized_matrix(qtype, rows, cols, rng).copy())
        products = {mode: kernels.product(qtype, blocks, rows, cols, mode) for mode in MODES}
        for num_rows in args.rows:
            x = torch.randn(num_rows, cols, generator=torch.Generator().manual_seed(num_rows))
            times = call_times(products, x, args.repeats)
            best = {mode: min(t) for mode, t in times.items()}
            median = {mode: statistics.median(t) for mode, t in times.items()}
            gflops = {mode: 2 * num_rows * rows * cols / best[mode] / 1e9 for mode in MODES}
            shares = ", ".join(
                f"{gflops[mode]:.0f} ({gflops[mode] / limits[peaks[mode]]:.0%})" for mode in MODES
            )
            print(
                f"| {qtype} | {num_rows} | {1e6 * best['float32']:.0f} | "
                f"{1e6 * best['int8']:.0f} | {1e6 * best['int16']:.0f} | "
                f"{ratio(best, median, 'int8')} | {ratio(best, median, 'int16')} | {shares} |"
            )


if __name__ == "__main__":
    main()
