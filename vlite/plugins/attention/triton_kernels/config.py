"""Launch choices for the Triton attention kernels: tile sizes and the split-K heuristic.

Pure Python (no ``triton`` import), so the choices can be tested and printed anywhere.

Tiles. A program of the attention kernel owns ``block_q`` consecutive query tokens of one
sequence and *all* ``num_queries_per_kv`` query heads that share one KV head, so each K/V
tile it loads from the cache serves the whole group (grouped-query attention reads the
cache once per group, not once per query head). Its query tile has ``block_m`` rows,
``block_q * group_p2`` padded up to 16, the smallest ``tl.dot`` operand on NVIDIA GPUs.
The inner loop walks the context ``tile_n`` keys at a time with an online softmax.

Split-K (flash-decoding). Without splitting there is one program per (query block, KV
head): a decode batch of 4 sequences with 8 KV heads launches 32 programs, a quarter of an
H100's 132 SMs, however long the contexts are. :func:`choose_num_splits` then cuts every
context into ``num_splits`` contiguous ranges of KV tiles, one program each; they write
partial results (unnormalised accumulator, running max and sum) that a small reduce kernel
combines.
"""

from __future__ import annotations

from dataclasses import dataclass

#: Smallest M, N and K of ``tl.dot`` on NVIDIA tensor cores.
MIN_DOT_DIM = 16
#: Split until about this many programs per SM are in flight ...
TARGET_PROGRAMS_PER_SM = 2
#: ... but never below this many keys per split (the fixed cost of a split and of the
#: reduce would outweigh the parallelism) ...
MIN_KEYS_PER_SPLIT = 256
#: ... and never into more than this many splits (bounds the reduce kernel's tile).
MAX_SPLITS = 64
#: Programs a CPU "device" is taken to run at once under the Triton interpreter: 1, so the
#: interpreter does not split by default (it would only add programs); tests force splits.
INTERPRETER_NUM_SMS = 1


def next_power_of_2(n: int) -> int:
    """Smallest power of two ``>= n`` (``n >= 1``)."""
    return 1 << (n - 1).bit_length()


@dataclass(frozen=True)
class AttentionTiles:
    """Tile sizes of one launch of the attention kernel.

    Attributes:
        block_q: query tokens per program (all of one sequence).
        group_p2: query heads per KV head, rounded up to a power of two.
        block_m: rows of the query tile, ``max(16, block_q * group_p2)``; row ``r`` is query
            token ``r // group_p2`` and head ``r % group_p2`` of the group.
        tile_n: keys per iteration of the online-softmax loop (independent of the cache's
            block size: each key's physical block is looked up in the block table).
        num_warps, num_stages: compiler hints on CUDA (ignored by the interpreter).
    """

    block_q: int
    group_p2: int
    block_m: int
    tile_n: int
    num_warps: int = 4
    num_stages: int = 2


def choose_tiles(
    num_queries_per_kv: int,
    head_dim: int,
    max_query_len: int,
    dtype_itemsize: int,
    interpreted: bool,
) -> AttentionTiles:
    """Tile sizes for a batch whose longest query has ``max_query_len`` tokens.

    Decode-only batches (``max_query_len == 1``) get one query token per program (16 rows:
    the group's heads, padded), so no row is spent on a neighbour's token; batches with
    prefills get 64 query rows per program. Keys per iteration: 64 for 16-bit dtypes up to
    head dim 128, 32 above. float32 (exact, no tensor-core tf32) uses 16-key tiles and at
    most 32 rows. These sizes compile for sm_90 without register spills (checked with
    ptxas' resource usage; tune them with ``benchmarks/attention.py`` on the GPU). Under the
    interpreter every Triton op costs a fixed Python overhead, so tiles are big: 128 rows,
    64 keys.
    """
    group_p2 = next_power_of_2(num_queries_per_kv)
    head_dim_p2 = next_power_of_2(head_dim)
    if interpreted:
        rows, tile_n, num_warps = 128, 64, 4
    elif dtype_itemsize >= 4:
        rows, tile_n, num_warps = 32, 16, 4
    else:
        rows = 64
        tile_n = 64 if head_dim_p2 <= 128 else 32
        num_warps = 4 if head_dim_p2 <= 64 else 8
    if max_query_len == 1:
        block_q = 1
    else:
        block_q = max(1, rows // group_p2)
        block_q = min(block_q, next_power_of_2(max_query_len))
    block_m = max(MIN_DOT_DIM, block_q * group_p2)
    return AttentionTiles(block_q, group_p2, block_m, tile_n, num_warps=num_warps, num_stages=2)


def num_query_blocks(num_tokens: int, num_seqs: int, block_q: int) -> int:
    """Programs along the query axis (some exit at once).

    Sequence ``s`` owns program indices from ``query_start_loc[s] // block_q + s``: that many
    slots always cover its ``ceil(query_len / block_q)`` blocks, and the kernel finds its
    sequence by binary search over these starts, with no host-side work. With
    ``block_q == 1`` every token is one block and the starts are ``query_start_loc``.
    """
    if block_q == 1:
        return num_tokens
    return num_tokens // block_q + num_seqs


def choose_num_splits(num_programs: int, max_seq_len: int, num_sms: int) -> int:
    """How many ranges to split each context into (1: no split-K).

    Args:
        num_programs: programs of the unsplit launch (query blocks x KV heads).
        max_seq_len: the longest context in the batch.
        num_sms: streaming multiprocessors of the device (:data:`INTERPRETER_NUM_SMS` on
            CPU).

    Split just enough to reach :data:`TARGET_PROGRAMS_PER_SM` programs per SM, keeping at
    least :data:`MIN_KEYS_PER_SPLIT` keys of the longest context per split and at most
    :data:`MAX_SPLITS` splits. Examples on an H100 (132 SMs) with 8 KV heads: batch 1 at
    8k context -> 32 splits; batch 16 at 2k -> 3; batch 64 -> 1.
    """
    target = TARGET_PROGRAMS_PER_SM * num_sms
    if num_programs >= target:
        return 1
    wanted = -(-target // num_programs)
    most_by_length = max(1, max_seq_len // MIN_KEYS_PER_SPLIT)
    return max(1, min(wanted, most_by_length, MAX_SPLITS))
