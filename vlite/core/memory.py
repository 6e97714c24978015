"""The memory plan: what the weights and the KV cache hold, and how a run sizes its cache.

Workers report what they hold (:class:`WorkerMemory`: the bytes of their model's weights and
of one KV-cache block for their own layers and heads); the engine core adds them up with
the number of blocks into a :class:`MemoryPlan`, which ``vlite run`` and ``vlite serve``
print at start and which ``EngineCore.memory_plan`` keeps.

:func:`kv_cache_tokens_for_requests` is the sizing rule of a run whose requests are known
before the engine is built (``vlite run``): the cache holds every sequence that can run at
once at its longest.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import msgspec

from vlite.core.errors import ConfigError


class WorkerMemory(msgspec.Struct, frozen=True, array_like=True):
    """What one worker holds.

    Args:
        weights_bytes: its model's (or shard's) parameters, buffers and quantized weights.
        kv_cache_block_bytes: one KV-cache block over its own layers and heads.
    """

    weights_bytes: int
    kv_cache_block_bytes: int


class MemoryPlan(msgspec.Struct, frozen=True, array_like=True):
    """The model's and the KV cache's memory, over every worker together.

    Args:
        weights_bytes: every worker's weights (tensor-parallel shards and pipeline stages
            add up).
        kv_cache_blocks: blocks in the cache; every worker has each block, for its layers.
        kv_cache_block_bytes: one block over every worker.
        block_size: token slots per block.
        num_workers: the workers these sums cover.
    """

    weights_bytes: int
    kv_cache_blocks: int
    kv_cache_block_bytes: int
    block_size: int
    num_workers: int = 1

    @classmethod
    def from_workers(
        cls, workers: Sequence[WorkerMemory], kv_cache_blocks: int, block_size: int
    ) -> MemoryPlan:
        """The plan of ``workers`` (at least one) with a cache of ``kv_cache_blocks``.

        Raises:
            ValueError: ``workers`` is empty.
        """
        if not workers:
            raise ValueError("a memory plan needs the report of at least one worker")
        return cls(
            weights_bytes=sum(w.weights_bytes for w in workers),
            kv_cache_blocks=kv_cache_blocks,
            kv_cache_block_bytes=sum(w.kv_cache_block_bytes for w in workers),
            block_size=block_size,
            num_workers=len(workers),
        )

    @property
    def kv_cache_bytes(self) -> int:
        """The whole cache: blocks x bytes per block."""
        return self.kv_cache_blocks * self.kv_cache_block_bytes

    @property
    def kv_cache_tokens(self) -> int:
        """Tokens the cache holds: blocks x block size."""
        return self.kv_cache_blocks * self.block_size

    @property
    def total_bytes(self) -> int:
        """Weights and KV cache (activations and the runtime come on top)."""
        return self.weights_bytes + self.kv_cache_bytes

    def describe(self) -> str:
        """One line: ``weights 92.0 MiB, KV cache 5 blocks x 720.0 KiB = 3.5 MiB (80
        tokens)``, and the number of workers when there are several."""
        workers = f" over {self.num_workers} workers" if self.num_workers > 1 else ""
        blocks = "block" if self.kv_cache_blocks == 1 else "blocks"
        return (
            f"weights {format_bytes(self.weights_bytes)}, KV cache {self.kv_cache_blocks} "
            f"{blocks} x {format_bytes(self.kv_cache_block_bytes)} = "
            f"{format_bytes(self.kv_cache_bytes)} ({self.kv_cache_tokens} tokens){workers}"
        )


def format_bytes(num_bytes: int) -> str:
    """``num_bytes`` in the largest binary unit it reaches (B, KiB, MiB, GiB, TiB)."""
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024:
            return f"{num_bytes} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


def kv_cache_tokens_for_requests(
    sequences: Iterable[tuple[int, int]],
    *,
    max_model_len: int,
    block_size: int,
    max_num_seqs: int,
) -> int:
    """The KV-cache tokens a known set of requests can use, in whole blocks.

    Each sequence (a request's sample; ``n`` samples are ``n`` sequences) holds at most
    ``min(prompt tokens + max_tokens, max_model_len)`` tokens — the bound the engine core
    checks a request against — rounded up to whole blocks, and at least one block. At most
    ``max_num_seqs`` sequences run at once, so the cache needs the blocks of the
    ``max_num_seqs`` largest. A cache of this size holds every sequence that can run at once
    at its longest: the run never preempts for want of blocks.

    Args:
        sequences: ``(num_prompt_tokens, max_tokens)`` per sequence.
        max_model_len: the engine's context length.
        block_size: token slots per block.
        max_num_seqs: the most sequences in one step.

    Raises:
        ValueError: no sequences, or a size, length or count below 1 (naming it).
    """
    for name, value in (
        ("max_model_len", max_model_len),
        ("block_size", block_size),
        ("max_num_seqs", max_num_seqs),
    ):
        if value < 1:
            raise ConfigError(f"{name}={value} is invalid: must be >= 1")
    blocks = []
    for num_prompt_tokens, max_tokens in sequences:
        num_tokens = min(num_prompt_tokens + max_tokens, max_model_len)
        blocks.append(max(1, -(-num_tokens // block_size)))
    if not blocks:
        raise ValueError("sizing a KV cache for requests needs at least one sequence")
    largest = sorted(blocks, reverse=True)[:max_num_seqs]
    return sum(largest) * block_size
