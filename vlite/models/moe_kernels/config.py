"""Tile sizes of the grouped-GEMM kernel (pure Python: no ``triton`` import).

One :class:`MoETiles` serves both launches of a layer's step, because both walk the same
:class:`~vlite.models.moe_kernels.align.ExpertBlocks` (``block_m`` rows per block).

On a GPU, ``block_m`` follows the pairs an expert gets on average (a decode step gives each
expert a few rows; padding them to 64 would waste most of the tile), and ``block_k`` is
halved for float32, whose tiles take twice the shared memory. Under the interpreter, whose
cost is per program and per operation, tiles are as wide as the matrices (up to 128) and
``block_m`` is the smallest ``tl.dot`` accepts.
"""

from __future__ import annotations

from dataclasses import dataclass

from vlite.core.errors import ConfigError

#: The smallest tile edge ``tl.dot`` accepts.
MIN_DOT_TILE = 16
#: The widest N and K tiles used under the interpreter.
INTERPRETER_MAX_TILE = 128


@dataclass(frozen=True)
class MoETiles:
    """One grouped-GEMM configuration.

    Attributes:
        block_m: rows (token-expert pairs) per block; every expert's rows are padded to a
            multiple of it.
        block_n: output columns per program.
        block_k: the inner dimension's step.
        num_warps, num_stages: Triton launch options (ignored by the interpreter).
    """

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k"):
            value = getattr(self, name)
            if value < MIN_DOT_TILE or value & (value - 1):
                raise ConfigError(
                    f"{name}={value}: tiles must be powers of two of at least {MIN_DOT_TILE}"
                )


def next_power_of_2(n: int) -> int:
    """The smallest power of two ``>= n`` (1 for ``n <= 1``)."""
    return 1 << max(0, n - 1).bit_length()


def choose_tiles(
    num_pairs: int,
    num_local_experts: int,
    widest: int,
    element_size: int,
    interpreted: bool,
) -> MoETiles:
    """The tiles for a step of ``num_pairs`` (token, expert) pairs.

    Args:
        num_pairs: tokens times ``top_k``.
        num_local_experts: the experts this rank holds.
        widest: the largest N or K of the two launches (``max(hidden, 2 * intermediate)``).
        element_size: bytes per activation element (4 for float32, 2 for bfloat16).
        interpreted: whether the kernels run under the Triton interpreter.
    """
    if interpreted:
        edge = min(INTERPRETER_MAX_TILE, max(MIN_DOT_TILE, next_power_of_2(widest)))
        return MoETiles(block_m=MIN_DOT_TILE, block_n=edge, block_k=edge)
    rows_per_expert = num_pairs / max(1, num_local_experts)
    block_k = 64 if element_size <= 2 else 32
    if rows_per_expert <= 16:
        return MoETiles(block_m=16, block_n=64, block_k=2 * block_k, num_stages=4)
    if rows_per_expert <= 64:
        return MoETiles(block_m=32, block_n=64, block_k=block_k)
    return MoETiles(block_m=64, block_n=128, block_k=block_k, num_warps=8 if block_k == 64 else 4)
