"""The C kernel takes a token's keys in chunks of 256 at fixed positions: spread over the
threads in a step of few tokens, in turn within one work item otherwise. Both give the
reference's result, and the same bits for a token whatever its batch or the threads."""

from __future__ import annotations

import pytest
import torch

from vlite.kernels import native
from vlite.plugins.attention.cpu_native import CpuAttentionBackend
from vlite.testing.attention_cases import AttentionShape, run_case

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16


@pytest.fixture(scope="module")
def kernel() -> native.PagedAttentionKernel:
    reason = native.unavailable_reason()
    if reason is not None:
        pytest.skip(reason)  # no C compiler here
    return native.paged_attention_kernel()


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("window", [None, 300])
def test_long_contexts_match_dense_attention(kernel, cache_dtype, window):
    """Decodes alone (chunks spread) and beside many tokens (chunks in turn), contexts that
    end inside a chunk, on its edge and past several, with and without a window."""
    shape = AttentionShape(HEAD_DIM, HEADS // KV_HEADS, BLOCK)
    backend = CpuAttentionBackend(shape.num_heads, shape.num_kv_heads, HEAD_DIM, shape.scale, BLOCK)
    for batch in ([(700, 1)], [(255, 1), (256, 1), (511, 2)], [(600, 40), (900, 1), (20, 30)]):
        results = run_case(
            backend, shape, batch, seed=len(batch), sliding_window=window, cache_dtype=cache_dtype
        )
        for result in results:
            torch.testing.assert_close(
                result.output.double(), result.expected, atol=1e-4, rtol=1e-4
            )


def _decode(kernel, cache, tables, lengths, query, key, value) -> torch.Tensor:
    """One decode step of the sequences ``lengths`` (their new token last)."""
    lengths = torch.tensor(lengths, dtype=torch.int32)
    rows = torch.arange(len(lengths))
    position = lengths.long() - 1
    slots = tables[rows, position // BLOCK].long() * BLOCK + position % BLOCK
    step = kernel.step(
        slots,
        tables.contiguous(),
        lengths,
        torch.arange(len(lengths) + 1, dtype=torch.int32),
        HEAD_DIM**-0.5,
    )
    return step(query, key, value, cache)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.float16], ids=str)
def test_a_token_s_bits_do_not_depend_on_its_batch_or_the_threads(kernel, cache_dtype):
    gen = torch.Generator().manual_seed(3)
    num_seqs, blocks_per_seq = 40, 64
    cache = torch.randn(2, num_seqs * blocks_per_seq, BLOCK, KV_HEADS, HEAD_DIM, generator=gen)
    cache = cache.to(cache_dtype)
    tables = torch.randperm(num_seqs * blocks_per_seq, generator=gen).int()
    tables = tables.view(num_seqs, blocks_per_seq)
    lengths = [int(n) for n in torch.randint(1, blocks_per_seq * BLOCK, (num_seqs,), generator=gen)]
    lengths[0] = 1000  # four chunks, the last partial
    query = torch.randn(num_seqs, HEADS, HEAD_DIM, generator=gen)
    key = torch.randn(num_seqs, KV_HEADS, HEAD_DIM, generator=gen)
    value = torch.randn(num_seqs, KV_HEADS, HEAD_DIM, generator=gen)
    together = _decode(kernel, cache.clone(), tables, lengths, query, key, value)
    threads = torch.get_num_threads()
    try:
        for num_threads in (1, 2, 3):
            torch.set_num_threads(num_threads)
            alone = _decode(
                kernel, cache.clone(), tables[:1], lengths[:1], query[:1], key[:1], value[:1]
            )
            assert torch.equal(alone[0], together[0]), num_threads
    finally:
        torch.set_num_threads(threads)
