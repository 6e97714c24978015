"""The Triton kernels against dense float64 attention (``vlite.testing.attention_cases``).

Without a GPU they run under the Triton interpreter on CPU, so shapes are small and cases
few. Every case drives three steps on one cache first filled with garbage (the cached
prefixes, a mixed batch of prefills, cached-prefix prefills and decodes, then one decode
each), so stale slots past a sequence's end would show. Tolerances: float32 ``atol = rtol
= 1e-4``, bfloat16 ``3e-2``, float16 ``1e-2``, as in the conformance suite.
"""

from __future__ import annotations

import random

import pytest
import torch

from vlite.plugins.attention.triton_paged import TritonAttentionBackend
from vlite.testing.attention_cases import (
    AttentionShape,
    build_metadata,
    dense_causal_attention,
    random_batch,
    run_case,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCES = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 1e-2}


@pytest.fixture(scope="module")
def kernels():
    from vlite.plugins.attention.triton_kernels import load_kernels

    return load_kernels()


def make_backend(shape: AttentionShape, num_splits: int | None = None) -> TritonAttentionBackend:
    backend = TritonAttentionBackend(
        shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.scale, shape.block_size
    )
    backend.num_splits = num_splits
    return backend


def check(backend, shape, batch, dtype=torch.float32, seed=0, sliding_window=None) -> None:
    tol = TOLERANCES[dtype]
    for result in run_case(backend, shape, batch, dtype, seed, DEVICE, sliding_window):
        assert result.output.dtype == dtype
        torch.testing.assert_close(
            result.output.double(),
            result.expected,
            atol=tol,
            rtol=tol,
            msg=lambda m, r=result: f"{shape}, {r.step} step of {r.batch}: {m}",
        )


# ---- write_kv --------------------------------------------------------------------------


@pytest.mark.parametrize("num_kv_heads, head_dim", [(2, 64), (3, 128)])
def test_write_kv_stores_each_token_at_its_slot_and_nothing_else(kernels, num_kv_heads, head_dim):
    gen = torch.Generator().manual_seed(0)
    num_blocks, block_size, num_tokens = 6, 16, 37
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    before = cache.clone()
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    # Keys and values as strided views of one fused projection, as the model makes them.
    fused = torch.randn(num_tokens, 3 * num_kv_heads, head_dim, generator=gen)
    key, value = fused[:, :num_kv_heads], fused[:, 2 * num_kv_heads :]
    cache, key, value, slots = (t.to(DEVICE) for t in (cache, key, value, slots))

    kernels.write_kv(key, value, cache[0], cache[1], slots)

    flat = cache.view(2, -1, num_kv_heads, head_dim).cpu()
    assert torch.equal(flat[0, slots.cpu()], key.cpu())
    assert torch.equal(flat[1, slots.cpu()], value.cpu())
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
    untouched[slots.cpu()] = False
    flat_before = before.view(2, -1, num_kv_heads, head_dim)
    assert torch.equal(flat[:, untouched], flat_before[:, untouched])


def test_write_kv_skips_negative_slots_and_converts_to_the_cache_dtype(kernels):
    cache = torch.zeros(2, 2, 16, 2, 64, dtype=torch.bfloat16, device=DEVICE)
    key = torch.randn(3, 2, 64, device=DEVICE)
    value = torch.randn(3, 2, 64, device=DEVICE)
    slots = torch.tensor([5, -1, 20], device=DEVICE)

    kernels.write_kv(key, value, cache[0], cache[1], slots)

    flat = cache.view(2, -1, 2, 64)
    # Within one bfloat16 rounding step (the interpreter rounds toward zero, GPUs to nearest).
    ulp = 2**-7
    torch.testing.assert_close(flat[0, [5, 20]].float(), key[[0, 2]], atol=0, rtol=ulp)
    torch.testing.assert_close(flat[1, [5, 20]].float(), value[[0, 2]], atol=0, rtol=ulp)
    others = [slot for slot in range(32) if slot not in (5, 20)]  # -1 would wrap to 31
    assert not flat[:, others].any()


# ---- attention -------------------------------------------------------------------------

#: (head_dim, query heads per KV head, block size): GQA ratios 1-4 (3: a group that is
#: not a power of two), head dims 64 and 128, block sizes 16 and 32.
SHAPES = [
    AttentionShape(64, 1, 16),
    AttentionShape(64, 3, 32),
    AttentionShape(128, 4, 16),
    AttentionShape(128, 2, 32),
]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_random_mixed_batches_match_dense_attention(kernels, shape):
    rng = random.Random(str(shape))
    check(make_backend(shape), shape, random_batch(rng, shape.block_size), seed=rng.randrange(99))


def test_long_prefill_spans_several_query_blocks_beside_decodes(kernels):
    # 150 new tokens after a 40-token prefix: several query blocks of one sequence, each
    # with its own causal bound; decodes and a short prompt share the launch.
    shape = AttentionShape(64, 2, 16)
    check(make_backend(shape), shape, [(40, 150), (70, 1), (0, 9), (15, 1)])


@pytest.mark.parametrize("num_splits", [3, 7])
def test_split_k_matches_dense_attention(kernels, num_splits):
    """Forced splits on decodes and on a mixed batch; 7 leaves some splits empty."""
    shape = AttentionShape(64, 4, 16)
    batch = [(100, 1), (3, 1), (47, 1), (60, 20), (0, 33)]
    check(make_backend(shape, num_splits), shape, batch, seed=num_splits)


@pytest.mark.parametrize("num_splits", [None, 3])
@pytest.mark.parametrize("window", [5, 16, 37])
def test_sliding_window_over_query_blocks_and_splits(kernels, window, num_splits):
    """Windows shorter than, equal to and longer than a cache block, over a long prefill
    (several query blocks, each with its own lower window edge), cached-prefix prefills and
    decodes, with the keys split or not; out-of-window blocks hold fresh garbage."""
    shape = AttentionShape(64, 2, 16)
    batch = [(40, 150), (70, 1), (0, 9), (15, 1), (33, 20)]
    check(make_backend(shape, num_splits), shape, batch, seed=window, sliding_window=window)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_low_precision_matches_within_tolerance(kernels, dtype):
    shape = AttentionShape(64, 2, 16)
    check(make_backend(shape, num_splits=None), shape, [(20, 1), (16, 17), (0, 33)], dtype)


def test_strided_query_and_output_shape(kernels):
    """A query that is a view of a fused QKV projection (row stride > heads * head_dim)."""
    shape = AttentionShape(64, 2, 16)
    spans, table = [(0, 21)], [[3, 1]]
    metadata = build_metadata(table, spans, shape.block_size, torch.device(DEVICE))
    gen = torch.Generator().manual_seed(0)
    width = shape.num_heads + 2 * shape.num_kv_heads
    fused = torch.randn(21, width, shape.head_dim, generator=gen)
    query = fused[:, : shape.num_heads]
    key = fused[:, shape.num_heads : shape.num_heads + shape.num_kv_heads]
    value = fused[:, shape.num_heads + shape.num_kv_heads :]
    cache = torch.zeros(2, 4, 16, shape.num_kv_heads, shape.head_dim)
    backend = make_backend(shape)
    out = backend.forward(*(t.to(DEVICE) for t in (query, key, value, cache)), metadata)
    assert out.shape == query.shape and out.is_contiguous()
    expected = dense_causal_attention(query, key, value, shape.scale)
    torch.testing.assert_close(out.cpu().double(), expected, atol=1e-4, rtol=1e-4)
