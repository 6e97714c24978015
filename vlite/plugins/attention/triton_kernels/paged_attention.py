"""Paged attention for a flattened batch that mixes prefill chunks and decodes, in Triton.

One kernel serves every batch: each program takes ``block_q`` query tokens of one
sequence and the query heads of one KV head's group, walks that sequence's context through
its block table ``tile_n`` keys at a time with an online softmax (``exp2``, running max and
sum in float32), and masks causally: a query at context position ``p`` sees keys ``<= p``,
so cached prefixes, prompt chunks and one-token decodes need no separate paths. A windowed
layer (``SLIDING``) starts each program at the tile of its first row's first visible key
and masks the window's lower edge as it masks the causal one.

Grid: ``(query blocks, KV heads, splits)``. With ``num_splits > 1`` (split-K /
flash-decoding, see :func:`~.config.choose_num_splits`) each program covers one contiguous
range of its context's KV tiles and writes an unnormalised partial result with its
running max and sum; :func:`_reduce_splits_kernel` combines them per (token, head).

Tiles whose keys all lie at or before a block's first query (most of a long context) go
through an unmasked copy of the loop body; only the last tiles pay for the causal mask.
Each KV tile is loaded once for all query heads of its group (GQA), K as ``[head_dim,
tile_n]`` straight into ``tl.dot``; V is loaded after the softmax step, so its tile is
not live across it. Index arithmetic is int64.

Besides their own ``_attend_tile``, the kernels call only builtins of ``triton.language``:
reductions use ``tl.reduce`` with the standard library's combine functions instead of
``tl.max`` / ``tl.sum``, and ``tl.full`` replaces ``tl.zeros``. ``tl.max`` and friends are
``@triton.jit`` functions made compiled-or-interpreted once, when ``triton`` itself is
imported; avoiding them keeps these kernels runnable under the interpreter even when
something (``torch.profiler``, say) imported ``triton`` before vlite set
``TRITON_INTERPRET=1``. Import this module through
:func:`vlite.plugins.attention.triton_kernels.load_kernels`, which sets it first.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from vlite.plugins.attention.triton_kernels.config import (
    INTERPRETER_NUM_SMS,
    choose_num_splits,
    choose_tiles,
    next_power_of_2,
    num_query_blocks,
)

# The combine functions behind tl.max / tl.sum (the interpreter recognises them and reduces
# with numpy; compiled, tl.reduce with them is exactly tl.max / tl.sum).
_MAX = tl.standard._elementwise_max
_ADD = tl.standard._sum_combine

LOG2_E = 1.4426950408889634


@triton.jit
def _attend_tile(
    q,  # [BLOCK_M, HEAD_DIM_P2]
    acc,  # [BLOCK_M, HEAD_DIM_P2] float32, unnormalised
    m_i,  # [BLOCK_M] float32, running max of the scaled scores (log2 domain)
    l_i,  # [BLOCK_M] float32, running sum of exp2(score - m_i)
    k_base,  # cache pointers offset to this program's KV head
    v_base,
    table_row,  # this sequence's block-table row
    tile,
    num_keys,
    query_pos,  # [BLOCK_M] context position of each row's query
    dims,  # [HEAD_DIM_P2]
    qk_scale,
    window,  # the layer's sliding window (read only when SLIDING)
    soft_cap,  # the layer's logit cap times log2(e) (read only when SOFT_CAP)
    stride_cache_block,
    stride_cache_slot,
    SLIDING: tl.constexpr,
    SOFT_CAP: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P2: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    MASKED: tl.constexpr,
):
    """One online-softmax step over keys ``[tile * TILE_N, (tile + 1) * TILE_N)``.

    Unmasked tiles (``MASKED=False``) must be wholly visible to every row; masked ones hide
    keys after a row's query and, when ``SLIDING``, keys at or before ``query - window``.
    """
    first_key = tile * TILE_N
    if TILE_N <= BLOCK_SIZE:
        # The tile lies in one cache block: one block id, contiguous slots.
        block_id = tl.load(table_row + first_key // BLOCK_SIZE).to(tl.int64)
        slots = block_id * stride_cache_block + (
            (first_key % BLOCK_SIZE + tl.arange(0, TILE_N)) * stride_cache_slot
        )
    else:
        key_pos = first_key + tl.arange(0, TILE_N)
        if MASKED:
            block_ids = tl.load(table_row + key_pos // BLOCK_SIZE, mask=key_pos < num_keys, other=0)
        else:
            block_ids = tl.load(table_row + key_pos // BLOCK_SIZE)
        slots = block_ids.to(tl.int64) * stride_cache_block + (key_pos % BLOCK_SIZE) * (
            stride_cache_slot
        )
    # Load masks: keys past num_keys (last tile only) and padded head dims.
    k_mask = None
    v_mask = None
    other = None
    if MASKED or HEAD_DIM < HEAD_DIM_P2:
        other = 0.0
    if MASKED:
        key_pos = first_key + tl.arange(0, TILE_N)
        key_valid = key_pos < num_keys
        k_mask = key_valid[None, :]
        v_mask = key_valid[:, None]
    if HEAD_DIM < HEAD_DIM_P2:
        dim_valid = dims < HEAD_DIM
        if MASKED:
            k_mask = k_mask & dim_valid[:, None]
            v_mask = v_mask & dim_valid[None, :]
        else:
            k_mask = dim_valid[:, None]
            v_mask = dim_valid[None, :]

    k = tl.load(k_base + slots[None, :] + dims[:, None], mask=k_mask, other=other)  # [D, N]
    if UPCAST_DOT:
        k = k.to(tl.float32)
    scores = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale  # [BLOCK_M, TILE_N]
    if SOFT_CAP:
        # cap * tanh(s / cap) in the log2 domain, tanh(x) = 1 - 2 / (2^(2 log2(e) x) + 1).
        scores = soft_cap * (1.0 - 2.0 / (tl.exp2(2.8853900817779268 * scores / soft_cap) + 1.0))
    if MASKED:
        visible = (key_pos[None, :] <= query_pos[:, None]) & key_valid[None, :]
        if SLIDING:
            visible = visible & (key_pos[None, :] > query_pos[:, None] - window)
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.reduce(scores, 1, _MAX))
        # A row that has seen no key yet keeps m = -inf: shift it by 0 instead, so no
        # -inf - -inf = nan appears (its p and alpha are 0).
        m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_new = tl.maximum(m_i, tl.reduce(scores, 1, _MAX))
        m_shift = m_new
    p = tl.exp2(scores - m_shift[:, None])
    alpha = tl.exp2(m_i - m_shift)
    l_i = l_i * alpha + tl.reduce(p, 1, _ADD)

    # V is loaded only now, so its tile is not live across the softmax.
    v = tl.load(v_base + slots[:, None] + dims[None, :], mask=v_mask, other=other)  # [N, D]
    p = p.to(v.dtype)
    if UPCAST_DOT:
        p = p.to(tl.float32)
        v = v.to(tl.float32)
    acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def _paged_attention_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim] (NUM_SPLITS == 1)
    part_acc_ptr,  # [num_tokens, num_heads, NUM_SPLITS, head_dim] float32 (NUM_SPLITS > 1)
    part_max_ptr,  # [num_tokens, num_heads, NUM_SPLITS] float32, log2 domain
    part_sum_ptr,  # [num_tokens, num_heads, NUM_SPLITS] float32
    q_ptr,  # [num_tokens, num_heads, head_dim]
    k_cache_ptr,  # [num_blocks, BLOCK_SIZE, num_kv_heads, head_dim]
    v_cache_ptr,
    block_tables_ptr,  # [num_seqs, max_num_blocks] int32
    seq_lens_ptr,  # [num_seqs] int32
    query_start_loc_ptr,  # [num_seqs + 1] int32
    num_seqs,
    num_heads,
    qk_scale,  # softmax scale * log2(e)
    window,  # sliding window in keys (read only when SLIDING)
    soft_cap,  # logit soft cap * log2(e) (read only when SOFT_CAP)
    stride_q_token,
    stride_q_head,
    stride_o_token,
    stride_o_head,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    stride_table_row,
    BLOCK_SIZE: tl.constexpr,
    NUM_QUERIES_PER_KV: tl.constexpr,
    GROUP_P2: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TILE_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P2: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    ALL_DECODE: tl.constexpr,  # every sequence has one query token: program 0 axis = seq
    SLIDING: tl.constexpr,  # a windowed layer: query p sees keys (p - window, p]
    SOFT_CAP: tl.constexpr,  # scores become cap * tanh(score / cap) (Gemma 2)
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
):
    # Index arithmetic is int64 throughout: no overflow on big caches, and the interpreter
    # skips its (costly) int32 overflow checks.
    q_block = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)

    if ALL_DECODE:
        seq = q_block
    else:
        # Binary search: the last sequence whose first query block is <= q_block.
        lo = tl.full([], 0, tl.int64)  # a tensor, not a constexpr, even if num_seqs == 1
        hi = lo + num_seqs - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            first_block = tl.load(query_start_loc_ptr + mid) // BLOCK_Q
            if BLOCK_Q > 1:
                first_block += mid
            found = first_block <= q_block
            lo = tl.where(found, mid, lo)
            hi = tl.where(found, hi, mid - 1)
        seq = lo

    q_start = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    query_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if ALL_DECODE:
        first_q = q_start * 0
    else:
        seq_first_block = q_start // BLOCK_Q
        if BLOCK_Q > 1:
            seq_first_block += seq
        first_q = (q_block - seq_first_block) * BLOCK_Q  # index within the sequence's query
        if first_q >= query_len:
            return
    context_len = tl.load(seq_lens_ptr + seq) - query_len  # tokens before the first query

    # Row r of the query tile: query token first_q + r // GROUP_P2, head r % GROUP_P2 of
    # this KV head's group.
    rows = tl.arange(0, BLOCK_M)
    q_index = first_q + rows // GROUP_P2
    head = kv_head * NUM_QUERIES_PER_KV + rows % GROUP_P2
    row_valid = q_index < query_len
    if BLOCK_M > BLOCK_Q * GROUP_P2:
        row_valid = row_valid & (rows < BLOCK_Q * GROUP_P2)
    if GROUP_P2 > NUM_QUERIES_PER_KV:
        row_valid = row_valid & (rows % GROUP_P2 < NUM_QUERIES_PER_KV)
    dims = tl.arange(0, HEAD_DIM_P2)
    row_dim_mask = row_valid[:, None]
    if HEAD_DIM < HEAD_DIM_P2:
        row_dim_mask = row_dim_mask & (dims < HEAD_DIM)[None, :]
    token = q_start + q_index
    q_offsets = token[:, None] * stride_q_token + head[:, None] * stride_q_head + dims[None, :]
    q = tl.load(q_ptr + q_offsets, mask=row_dim_mask, other=0.0)
    if UPCAST_DOT:
        q = q.to(tl.float32)
    query_pos = context_len + q_index  # [BLOCK_M] context position of each row's query

    # Keys up to the block's last query, in tiles, maybe split into ranges of tiles. A
    # windowed layer starts at the tile holding the first row's first visible key.
    last_q = tl.minimum(first_q + BLOCK_Q, query_len)  # one past the block's last query
    num_keys = context_len + last_q
    num_tiles = (num_keys + TILE_N - 1) // TILE_N
    first_tile = num_tiles * 0
    # Tiles from inner_tile on lie wholly inside every row's window (no window mask).
    inner_tile = num_tiles * 0
    if SLIDING:
        first_tile = tl.maximum(context_len + first_q - window + 1, 0) // TILE_N
        inner_tile = (tl.maximum(num_keys - window, 0) + TILE_N - 1) // TILE_N
    if NUM_SPLITS > 1:
        tiles_per_split = (num_tiles - first_tile + NUM_SPLITS - 1) // NUM_SPLITS
        tile_lo = first_tile + split * tiles_per_split
        tile_hi = tl.minimum(tile_lo + tiles_per_split, num_tiles)
    else:
        tile_lo = first_tile
        tile_hi = num_tiles
    # Tiles before num_full_tiles lie wholly at or before the block's first query: every
    # row sees all their keys, so they need no causal mask (most of a long context).
    num_full_tiles = (context_len + first_q + 1) // TILE_N

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, tl.float32)
    acc = tl.full([BLOCK_M, HEAD_DIM_P2], 0.0, tl.float32)
    table_row = block_tables_ptr + seq * stride_table_row
    k_base = k_cache_ptr + kv_head * stride_cache_head
    v_base = v_cache_ptr + kv_head * stride_cache_head
    # Three runs of tiles: the window's lower edge (masked), the middle (unmasked), the
    # causal edge (masked). Without a window the first run is empty.
    middle_lo = tl.maximum(tile_lo, inner_tile)
    for tile in range(tile_lo, tl.minimum(inner_tile, tile_hi)):
        acc, m_i, l_i = _attend_tile(
            q, acc, m_i, l_i, k_base, v_base, table_row, tile, num_keys, query_pos, dims,
            qk_scale, window, soft_cap, stride_cache_block, stride_cache_slot, SLIDING, SOFT_CAP,
            BLOCK_SIZE, TILE_N, HEAD_DIM, HEAD_DIM_P2, DOT_PRECISION, UPCAST_DOT, True,
        )  # fmt: skip
    for tile in range(middle_lo, tl.minimum(tile_hi, num_full_tiles)):
        acc, m_i, l_i = _attend_tile(
            q, acc, m_i, l_i, k_base, v_base, table_row, tile, num_keys, query_pos, dims,
            qk_scale, window, soft_cap, stride_cache_block, stride_cache_slot, SLIDING, SOFT_CAP,
            BLOCK_SIZE, TILE_N, HEAD_DIM, HEAD_DIM_P2, DOT_PRECISION, UPCAST_DOT, False,
        )  # fmt: skip
    for tile in range(tl.maximum(middle_lo, num_full_tiles), tile_hi):
        acc, m_i, l_i = _attend_tile(
            q, acc, m_i, l_i, k_base, v_base, table_row, tile, num_keys, query_pos, dims,
            qk_scale, window, soft_cap, stride_cache_block, stride_cache_slot, SLIDING, SOFT_CAP,
            BLOCK_SIZE, TILE_N, HEAD_DIM, HEAD_DIM_P2, DOT_PRECISION, UPCAST_DOT, True,
        )  # fmt: skip

    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        o_offsets = token[:, None] * stride_o_token + head[:, None] * stride_o_head + dims[None, :]
        tl.store(out_ptr + o_offsets, out.to(out_ptr.dtype.element_ty), mask=row_dim_mask)
    else:
        part = (token * num_heads + head) * NUM_SPLITS + split  # [BLOCK_M]
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + dims[None, :], acc, mask=row_dim_mask)
        tl.store(part_max_ptr + part, m_i, mask=row_valid)
        tl.store(part_sum_ptr + part, l_i, mask=row_valid)


@triton.jit
def _reduce_splits_kernel(
    out_ptr,  # [num_tokens, num_heads, head_dim]
    part_acc_ptr,  # [num_tokens, num_heads, NUM_SPLITS, head_dim] float32
    part_max_ptr,  # [num_tokens, num_heads, NUM_SPLITS] float32
    part_sum_ptr,
    num_heads,
    stride_o_token,
    stride_o_head,
    NUM_SPLITS: tl.constexpr,
    SPLITS_P2: tl.constexpr,
    HEADS_PER_PROGRAM: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_P2: tl.constexpr,
):
    """Combine the splits of ``HEADS_PER_PROGRAM`` heads of one token (grid: tokens x
    head groups): ``out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s``."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64) * HEADS_PER_PROGRAM + tl.arange(0, HEADS_PER_PROGRAM)
    splits = tl.arange(0, SPLITS_P2)
    dims = tl.arange(0, HEAD_DIM_P2)
    part = (token * num_heads + head[:, None]) * NUM_SPLITS + splits[None, :]  # [H, S]
    valid = (head < num_heads)[:, None] & (splits < NUM_SPLITS)[None, :]
    m = tl.load(part_max_ptr + part, mask=valid, other=float("-inf"))
    l_sum = tl.load(part_sum_ptr + part, mask=valid, other=0.0)
    acc_mask = valid[:, :, None]
    if HEAD_DIM < HEAD_DIM_P2:
        acc_mask = acc_mask & (dims < HEAD_DIM)[None, None, :]
    acc = tl.load(
        part_acc_ptr + part[:, :, None] * HEAD_DIM + dims[None, None, :], mask=acc_mask, other=0.0
    )
    # Split 0 holds each context's first key, so the max over splits is finite; empty
    # splits (m = -inf) and padding get weight 0. Padding heads divide 0 by 1.
    m_max = tl.reduce(m, 1, _MAX)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    weight = tl.exp2(m - m_max[:, None])  # [H, S]
    total = tl.reduce(weight * l_sum, 1, _ADD)
    total = tl.where(total == 0.0, 1.0, total)
    out = tl.reduce(acc * weight[:, :, None], 1, _ADD) / total[:, None]  # [H, D]
    o_offsets = token * stride_o_token + head[:, None] * stride_o_head + dims[None, :]
    out_mask = (head < num_heads)[:, None] & (dims < HEAD_DIM)[None, :]
    tl.store(out_ptr + o_offsets, out.to(out_ptr.dtype.element_ty), mask=out_mask)


class SplitWorkspace:
    """A grow-only float32 buffer for split-K partial results, reused across calls."""

    def __init__(self) -> None:
        self._buffer: torch.Tensor | None = None

    def get(self, numel: int, device: torch.device) -> torch.Tensor:
        buffer = self._buffer
        if buffer is None or buffer.numel() < numel or buffer.device != device:
            buffer = torch.empty(numel, dtype=torch.float32, device=device)
            self._buffer = buffer
        return buffer[:numel]


def is_interpreted() -> bool:
    """Whether this module's kernels run under the Triton interpreter."""
    return type(_paged_attention_kernel).__name__ == "InterpretedFunction"


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda" or is_interpreted():
        return INTERPRETER_NUM_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    *,
    max_query_len: int,
    max_seq_len: int,
    scale: float,
    num_splits: int | None = None,
    workspace: SplitWorkspace | None = None,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> torch.Tensor:
    """Causal attention of a flattened batch over a paged KV cache.

    Args:
        query: ``[num_tokens, num_heads, head_dim]`` (last dimension contiguous).
        key_cache, value_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``.
        block_tables: ``[num_seqs, max_num_blocks]`` int32.
        seq_lens: ``[num_seqs]`` int32, context lengths including the new tokens.
        query_start_loc: ``[num_seqs + 1]`` int32, cumulative query lengths.
        max_query_len, max_seq_len: host ints bounding the launch (no device sync).
        scale: softmax scale.
        num_splits: force the number of split-K ranges (``None``: the heuristic).
        workspace: where split-K partials live; reused across calls when given.
        sliding_window: the layer's window, if any: the query at position ``p`` sees keys
            ``(p - sliding_window, p]``; tiles before the first row's window are not read.
        logits_soft_cap: the layer's soft cap, if any: scores become ``cap * tanh(score /
            cap)`` before masking.

    Returns:
        ``[num_tokens, num_heads, head_dim]`` in ``query``'s dtype.
    """
    num_tokens, num_heads, head_dim = query.shape
    num_seqs = seq_lens.shape[0]
    _, block_size, num_kv_heads, _ = key_cache.shape
    if query.stride(-1) != 1:
        query = query.contiguous()
    if key_cache.stride(-1) != 1 or key_cache.stride() != value_cache.stride():
        raise ValueError("key and value caches must share strides, head_dim contiguous")
    output = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if num_tokens == 0:
        return output
    interpreted = is_interpreted()
    # The interpreter (Triton 3.x) multiplies bfloat16 tiles wrongly; it gets float32 tiles
    # holding the same values (products exact, sums in float32, as on a GPU).
    upcast_dot = interpreted and query.dtype != torch.float32
    group = num_heads // num_kv_heads
    tiles = choose_tiles(group, head_dim, max_query_len, query.element_size(), interpreted)
    grid_q = num_query_blocks(num_tokens, num_seqs, tiles.block_q)
    if num_splits is None:
        keys_read = max_seq_len
        if sliding_window is not None:
            keys_read = min(max_seq_len, sliding_window + max_query_len)
        num_splits = choose_num_splits(grid_q * num_kv_heads, keys_read, _num_sms(query.device))
    part_acc = part_max = part_sum = output  # unused placeholders when not splitting
    if num_splits > 1:
        num_parts = num_tokens * num_heads * num_splits
        buffer = (workspace or SplitWorkspace()).get(num_parts * (head_dim + 2), query.device)
        part_acc = buffer[: num_parts * head_dim]
        part_max = buffer[num_parts * head_dim : num_parts * (head_dim + 1)]
        part_sum = buffer[num_parts * (head_dim + 1) :]
    _paged_attention_kernel[(grid_q, num_kv_heads, num_splits)](
        output,
        part_acc,
        part_max,
        part_sum,
        query,
        key_cache,
        value_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        num_seqs,
        num_heads,
        scale * LOG2_E,
        sliding_window or 0,
        (logits_soft_cap or 1.0) * LOG2_E,
        query.stride(0),
        query.stride(1),
        output.stride(0),
        output.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        block_tables.stride(0),
        BLOCK_SIZE=block_size,
        NUM_QUERIES_PER_KV=group,
        GROUP_P2=tiles.group_p2,
        BLOCK_Q=tiles.block_q,
        BLOCK_M=tiles.block_m,
        TILE_N=tiles.tile_n,
        HEAD_DIM=head_dim,
        HEAD_DIM_P2=max(16, next_power_of_2(head_dim)),
        NUM_SPLITS=num_splits,
        ALL_DECODE=max_query_len == 1,
        SLIDING=sliding_window is not None,
        SOFT_CAP=logits_soft_cap is not None,
        # float32 operands must not be rounded to tf32: float32 is the correctness dtype.
        DOT_PRECISION="ieee" if query.dtype == torch.float32 or upcast_dot else "tf32",
        UPCAST_DOT=upcast_dot,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )
    if num_splits > 1:
        # One head per program on a GPU; all heads of a token under the interpreter, whose
        # cost is per program.
        heads_per_program = next_power_of_2(num_heads) if interpreted else 1
        _reduce_splits_kernel[(num_tokens, triton.cdiv(num_heads, heads_per_program))](
            output,
            part_acc,
            part_max,
            part_sum,
            num_heads,
            output.stride(0),
            output.stride(1),
            NUM_SPLITS=num_splits,
            SPLITS_P2=next_power_of_2(num_splits),
            HEADS_PER_PROGRAM=heads_per_program,
            HEAD_DIM=head_dim,
            HEAD_DIM_P2=max(16, next_power_of_2(head_dim)),
        )
    return output
