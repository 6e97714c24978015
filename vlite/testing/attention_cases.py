"""Random paged-attention batches and a dense float64 reference to check backends against.

A case is a batch of sequences, each ``(num_cached, num_new)``: ``num_cached`` tokens are
already in the cache and ``num_new`` arrive now. :func:`run_case` drives a backend through
the steps an engine would take, on one cache tensor in the backend's own layout (filled
with garbage first, so reading a slot that was never written shows):

1. ``prefix``: the cached prefixes are computed (a plain prefill of each);
2. ``batch``: the new tokens of every sequence, in one mixed batch;
3. ``decode``: one more token per sequence, which reads back what step 2 wrote.

Each step's output is compared with dense causal attention computed in float64 from the
same (dtype-rounded) queries, keys and values. With a ``sliding_window``, the blocks that
fall wholly before a step's first query's window are refilled with fresh garbage before the
step, as the engine's KV-cache manager may hand them to another request by then.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from vlite.core.attention import AttentionBackend, AttentionMetadata

NUM_KV_HEADS = 2

Batch = list[tuple[int, int]]


@dataclass(frozen=True)
class AttentionShape:
    """A layer shape: ``num_kv_heads * num_queries_per_kv`` query heads of ``head_dim``."""

    head_dim: int
    num_queries_per_kv: int
    block_size: int
    num_kv_heads: int = NUM_KV_HEADS
    #: The softmax scale; ``None``: ``head_dim ** -0.5``.
    softmax_scale: float | None = None

    @property
    def num_heads(self) -> int:
        return self.num_kv_heads * self.num_queries_per_kv

    @property
    def scale(self) -> float:
        return self.head_dim**-0.5 if self.softmax_scale is None else self.softmax_scale

    def __str__(self) -> str:
        name = f"hd{self.head_dim}-gqa{self.num_queries_per_kv}-bs{self.block_size}"
        return name if self.softmax_scale is None else f"{name}-scale{self.softmax_scale:g}"


def boundary_batch(block_size: int, with_cached_prefill: bool = True) -> Batch:
    """Sequences whose lengths sit on and around block boundaries.

    Without ``with_cached_prefill``, sequences bringing several tokens after cached context
    are left out (one-token decodes after context stay).
    """
    bs = block_size
    batch = [
        (0, 1),
        (0, bs),
        (0, bs + 1),
        (bs, 1),
        (bs - 1, 1),
        (2 * bs - 1, 2),
        (bs, bs),
        (bs + 1, 2 * bs + 3),
        (3 * bs, 5),
    ]
    return [seq for seq in batch if with_cached_prefill or seq[0] == 0 or seq[1] == 1]


def decode_batch(block_size: int) -> Batch:
    """Only one-token decodes, of contexts from 1 token to several blocks."""
    bs = block_size
    return [(0, 1), (1, 1), (bs - 1, 1), (bs, 1), (2 * bs + 1, 1), (4 * bs - 1, 1)]


def random_batch(rng: random.Random, block_size: int, with_cached_prefill: bool = True) -> Batch:
    """Two to six random sequences: fresh prefills, decodes and (maybe) cached prefills."""
    batch = []
    for _ in range(rng.randint(2, 6)):
        kind = rng.choice(["prefill", "decode", "cached"] if with_cached_prefill else ["p", "d"])
        if kind in ("prefill", "p"):
            batch.append((0, rng.randint(1, 3 * block_size + 1)))
        elif kind in ("decode", "d"):
            batch.append((rng.randint(1, 4 * block_size), 1))
        else:
            batch.append((rng.randint(1, 3 * block_size), rng.randint(2, 2 * block_size)))
    return batch


def dense_causal_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> torch.Tensor:
    """Attention of the last ``len(query)`` positions of a context, in float64.

    Args:
        query: ``[query_len, num_heads, head_dim]``.
        key, value: ``[seq_len, num_kv_heads, head_dim]``, the whole context.
        sliding_window: the query at position ``p`` sees keys ``(p - window, p]`` only.
        soft_cap: scores become ``cap * tanh(score / cap)`` (Gemma 2).

    Returns:
        ``[query_len, num_heads, head_dim]`` float64.
    """
    query_len, num_heads, _ = query.shape
    seq_len, num_kv_heads, _ = key.shape
    group = num_heads // num_kv_heads
    k = key.double().repeat_interleave(group, dim=1)
    v = value.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", query.double(), k) * scale
    if soft_cap is not None:
        scores = soft_cap * torch.tanh(scores / soft_cap)
    query_pos = torch.arange(seq_len - query_len, seq_len)[:, None]
    key_pos = torch.arange(seq_len)[None, :]
    hidden = key_pos > query_pos
    if sliding_window is not None:
        hidden |= key_pos <= query_pos - sliding_window
    scores = scores.masked_fill(hidden, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@dataclass
class StepResult:
    """One step of a case: the backend's output and the reference."""

    step: str
    batch: Batch
    output: torch.Tensor
    expected: torch.Tensor


def run_case(
    backend: AttentionBackend,
    shape: AttentionShape,
    batch: Batch,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    device: str | torch.device = "cpu",
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    cache_dtype: torch.dtype | None = None,
) -> list[StepResult]:
    """Drive ``backend`` through the prefix, batch and decode steps of ``batch``.

    Inputs are drawn on the CPU (so they do not depend on ``device``) and moved there;
    outputs come back on the CPU. ``sliding_window`` and ``soft_cap`` are passed to the
    backend (only when set) and to the reference. ``cache_dtype`` (default ``dtype``) is the
    KV cache's (``AttentionBackend.kv_cache_dtypes``): the reference then attends over the
    keys and values rounded to it, as the cache holds them.
    """
    layer_options: dict[str, float] = {}
    if sliding_window is not None:
        layer_options["sliding_window"] = sliding_window
    if soft_cap is not None:
        layer_options["logits_soft_cap"] = soft_cap
    device = torch.device(device)
    gen = torch.Generator().manual_seed(seed)
    bs = shape.block_size
    final_lens = [num_cached + num_new + 1 for num_cached, num_new in batch]
    blocks_per_seq = [-(-length // bs) for length in final_lens]
    num_blocks = sum(blocks_per_seq) + 3
    # Blocks scattered over a shuffled pool (block 0 included), so tables are not contiguous.
    pool = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [[pool.pop() for _ in range(n)] for n in blocks_per_seq]
    cache_shape = backend.kv_cache_shape(num_blocks)
    cache_dtype = dtype if cache_dtype is None else cache_dtype
    kv_cache = (10 * torch.randn(cache_shape, generator=gen)).to(device, cache_dtype)  # garbage
    qkv = []
    for length in final_lens:
        q = torch.randn(length, shape.num_heads, shape.head_dim, generator=gen).to(dtype)
        k = torch.randn(length, shape.num_kv_heads, shape.head_dim, generator=gen).to(dtype)
        v = torch.randn(length, shape.num_kv_heads, shape.head_dim, generator=gen).to(dtype)
        qkv.append((q, k, v))

    steps = [
        ("prefix", [(0, c) if c else None for c, _ in batch]),
        ("batch", list(batch)),
        ("decode", [(c + n, 1) for c, n in batch]),
    ]
    results = []
    for step_name, spans in steps:
        chosen = [i for i, span in enumerate(spans) if span is not None]
        if not chosen:
            continue
        step_spans = [spans[i] for i in chosen]
        metadata = build_metadata([tables[i] for i in chosen], step_spans, bs, device)
        query, key, value = (
            torch.cat([qkv[i][j][s : s + n] for i, (s, n) in zip(chosen, step_spans)]).to(device)
            for j in range(3)
        )
        if sliding_window is not None:
            for i, (start, _) in zip(chosen, step_spans):
                num_gone = max(0, start - sliding_window + 1) // bs
                _refill_blocks(kv_cache, tables[i][:num_gone], gen)
        output = backend.forward(query, key, value, kv_cache, metadata, **layer_options).cpu()
        expected = torch.cat(
            [
                dense_causal_attention(
                    qkv[i][0][s : s + n],
                    qkv[i][1][: s + n].to(cache_dtype).to(dtype),
                    qkv[i][2][: s + n].to(cache_dtype).to(dtype),
                    shape.scale,
                    sliding_window,
                    soft_cap,
                )
                for i, (s, n) in zip(chosen, step_spans)
            ]
        )
        results.append(StepResult(step_name, step_spans, output, expected))
    return results


def run_draft_case(
    backend: AttentionBackend,
    shape: AttentionShape,
    context: int,
    num_drafts: int,
    seed: int = 0,
    device: str | torch.device = "cpu",
) -> list[StepResult]:
    """A sequence of ``context`` tokens computed as a prompt, then a step that verifies
    ``num_drafts`` draft tokens as the engine lays it out: ``num_drafts + 1`` one-token
    sequences over the one block table, at positions ``context..context + num_drafts``
    (each must see the keys the step writes for the positions before it)."""
    device = torch.device(device)
    gen = torch.Generator().manual_seed(seed)
    bs = shape.block_size
    length = context + num_drafts + 1
    num_blocks = -(-length // bs) + 3
    table = torch.randperm(num_blocks, generator=gen).tolist()[: -(-length // bs)]
    kv_cache = (10 * torch.randn(backend.kv_cache_shape(num_blocks), generator=gen)).to(device)
    q = torch.randn(length, shape.num_heads, shape.head_dim, generator=gen)
    k = torch.randn(length, shape.num_kv_heads, shape.head_dim, generator=gen)
    v = torch.randn(length, shape.num_kv_heads, shape.head_dim, generator=gen)
    results = []
    steps = [
        ("prompt", [(0, context)]),
        ("drafts", [(context + i, 1) for i in range(num_drafts + 1)]),
    ]
    for step_name, spans in steps:
        metadata = build_metadata([table] * len(spans), spans, bs, device)
        rows = slice(spans[0][0], spans[-1][0] + spans[-1][1])
        output = backend.forward(
            q[rows].to(device), k[rows].to(device), v[rows].to(device), kv_cache, metadata
        ).cpu()
        expected = torch.cat(
            [
                dense_causal_attention(q[s : s + n], k[: s + n], v[: s + n], shape.scale)
                for s, n in spans
            ]
        )
        results.append(StepResult(step_name, spans, output, expected))
    return results


def _refill_blocks(kv_cache: torch.Tensor, block_ids: list[int], gen: torch.Generator) -> None:
    """Overwrite blocks of a cache in the default layout ``[2, num_blocks, ...]`` with new
    (finite) garbage, as another request reusing them would; other layouts are left alone."""
    if not block_ids or kv_cache.dim() < 2 or kv_cache.shape[0] != 2:
        return
    shape = (2, len(block_ids), *kv_cache.shape[2:])
    garbage = 10 * torch.randn(shape, generator=gen)
    kv_cache[:, block_ids] = garbage.to(kv_cache.device, kv_cache.dtype)


def build_metadata(
    tables: list[list[int]], spans: list[tuple[int, int]], block_size: int, device: torch.device
) -> AttentionMetadata:
    """Metadata for sequences with ``(num_computed, num_new)`` spans, as the engine builds it.

    Each block table row lists the blocks covering the sequence's context so far; rows are
    zero-padded to the longest.
    """
    query_lens = [n for _, n in spans]
    seq_lens = [s + n for s, n in spans]
    width = max(-(-length // block_size) for length in seq_lens)
    block_tables = torch.zeros(len(spans), width, dtype=torch.int32)
    slots = []
    for row, (table, seq_len, (start, num_new)) in enumerate(zip(tables, seq_lens, spans)):
        num_seq_blocks = -(-seq_len // block_size)
        block_tables[row, :num_seq_blocks] = torch.tensor(table[:num_seq_blocks])
        positions = torch.arange(start, start + num_new)
        blocks = torch.tensor(table, dtype=torch.int64)[positions // block_size]
        slots.append(blocks * block_size + positions % block_size)
    query_start_loc = torch.zeros(len(spans) + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.tensor(query_lens).cumsum(0)
    return AttentionMetadata(
        slot_mapping=torch.cat(slots).to(device),
        query_start_loc=query_start_loc.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=block_tables.to(device),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_lens_cpu=query_lens,
        seq_lens_cpu=seq_lens,
    )


def run_replay_case(
    backend: AttentionBackend,
    shape: AttentionShape,
    steps: list[list[int]],
    capacity: int,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    device: str | torch.device = "cpu",
) -> list[StepResult]:
    """Decode steps through one metadata object, as a captured CUDA graph replays them.

    ``steps[i]`` lists the context lengths (the new token included) of at most ``capacity``
    sequences. Each step's contexts but their last token are first written by an eager
    prefill through ``backend``; then the step's one-token decodes go through the *same*
    :class:`AttentionMetadata` every time: the one a graph of ``capacity`` rows is captured
    with (:meth:`~vlite.worker.cuda_graphs.DecodeInputBuffers.metadata`, ``max_seq_len``
    the longest context of all steps), its tensors rewritten in place and padded as the
    worker pads them. A backend that reads the capture-time host ints as a step's values,
    or keeps a stale tensor between calls, gets the later steps wrong. Results hold the
    step's real rows only.
    """
    from vlite.worker.cuda_graphs import DecodeInputBuffers

    device = torch.device(device)
    gen = torch.Generator().manual_seed(seed)
    bs = shape.block_size
    longest = max(max(step) for step in steps)
    num_blocks = max(sum(-(-length // bs) for length in step) for step in steps) + 2
    kv_cache = (10 * torch.randn(backend.kv_cache_shape(num_blocks), generator=gen)).to(
        device, dtype
    )
    buffers = DecodeInputBuffers(capacity, -(-longest // bs), device)
    replayed = buffers.metadata(capacity, longest)

    def random_rows(rows: int, heads: int) -> torch.Tensor:
        return torch.randn(rows, heads, shape.head_dim, generator=gen).to(dtype)

    results = []
    for step in steps:
        pool = torch.randperm(num_blocks, generator=gen).tolist()
        tables = [[pool.pop() for _ in range(-(-length // bs))] for length in step]
        heads = (shape.num_heads, shape.num_kv_heads, shape.num_kv_heads)
        qkv = [tuple(random_rows(n, h) for h in heads) for n in step]
        prefills = [i for i, length in enumerate(step) if length > 1]
        if prefills:
            spans = [(0, step[i] - 1) for i in prefills]
            metadata = build_metadata([tables[i] for i in prefills], spans, bs, device)
            query, key, value = (
                torch.cat([qkv[i][j][: step[i] - 1] for i in prefills]).to(device) for j in range(3)
            )
            backend.forward(query, key, value, kv_cache, metadata)
        eager = build_metadata(tables, [(length - 1, 1) for length in step], bs, device)
        tokens = torch.zeros(len(step), dtype=torch.int64, device=device)
        buffers.load(tokens, tokens, eager, capacity)
        padding = capacity - len(step)
        query, key, value = (
            torch.cat(
                [torch.stack([qkv[i][j][-1] for i in range(len(step))]), random_rows(padding, h)]
            ).to(device)
            for j, h in enumerate(heads)
        )
        output = backend.forward(query, key, value, kv_cache, replayed)[: len(step)].cpu()
        expected = torch.cat([dense_causal_attention(q[-1:], k, v, shape.scale) for q, k, v in qkv])
        results.append(StepResult("replay", [(n - 1, 1) for n in step], output, expected))
    return results
