"""TorchAttentionBackend against a naive dense causal attention computed in float64."""

from __future__ import annotations

import pytest
import torch

from vlite.core.attention import AttentionMetadata
from vlite.plugins.attention.torch_ref import TorchAttentionBackend, register_attention_backends

NUM_HEADS = 8

# Each batch is a list of (query_len, seq_len): seq_len - query_len tokens are already cached.
BATCHES = {
    "single-prefill": [(37, 37)],
    "prefills-crossing-blocks": [(16, 16), (33, 33), (65, 65)],
    "cached-prefix": [(17, 40), (3, 16), (32, 97)],
    "all-decode": [(1, 1), (1, 16), (1, 17), (1, 64), (1, 100)],
    "mixed": [(1, 50), (20, 20), (1, 17), (5, 70), (1, 1), (33, 33)],
}


def _build_case(batch, num_kv_heads, head_dim, block_size, seed=0):
    """Random full contexts, a cache pre-filled with each cached prefix, and metadata."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-seq_len // block_size) for _, seq_len in batch]
    num_blocks = sum(blocks_per_seq) + 3
    # Scatter sequences over a shuffled block pool so block tables are not contiguous.
    pool = torch.randperm(num_blocks, generator=gen).tolist()
    max_blocks = max(blocks_per_seq) + 2
    block_tables = torch.zeros(len(batch), max_blocks, dtype=torch.int32)
    cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    flat_cache = cache.view(2, -1, num_kv_heads, head_dim)
    contexts, queries, new_keys, new_values, slots = [], [], [], [], []
    for i, ((query_len, seq_len), n) in enumerate(zip(batch, blocks_per_seq, strict=True)):
        block_tables[i, :n] = torch.tensor([pool.pop() for _ in range(n)], dtype=torch.int32)
        pos = torch.arange(seq_len)
        seq_slots = block_tables[i, pos // block_size].long() * block_size + pos % block_size
        k = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen)
        v = torch.randn(seq_len, num_kv_heads, head_dim, generator=gen)
        q = torch.randn(query_len, NUM_HEADS, head_dim, generator=gen)
        cached = seq_len - query_len
        flat_cache[0, seq_slots[:cached]] = k[:cached]
        flat_cache[1, seq_slots[:cached]] = v[:cached]
        contexts.append((q, k, v))
        queries.append(q)
        new_keys.append(k[cached:])
        new_values.append(v[cached:])
        slots.append(seq_slots[cached:])
    query_lens = [q for q, _ in batch]
    seq_lens = [s for _, s in batch]
    metadata = AttentionMetadata(
        slot_mapping=torch.cat(slots),
        query_start_loc=torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()]).int(),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=block_tables,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_lens_cpu=query_lens,
        seq_lens_cpu=seq_lens,
    )
    inputs = (torch.cat(queries), torch.cat(new_keys), torch.cat(new_values), cache)
    return inputs, metadata, contexts


def naive_attention(q, k, v, scale):
    """Dense causal attention of the last ``len(q)`` positions; float64, heads repeated."""
    query_len, num_heads, _ = q.shape
    seq_len, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    k = k.double().repeat_interleave(group, dim=1)  # [seq_len, num_heads, dim]
    v = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    query_pos = torch.arange(seq_len - query_len, seq_len)[:, None]
    scores = scores.masked_fill(torch.arange(seq_len)[None, :] > query_pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


@pytest.mark.parametrize("batch_name", list(BATCHES))
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("head_dim", [64, 32])
@pytest.mark.parametrize("gqa_ratio", [1, 2, 4])
def test_matches_naive_attention(batch_name, block_size, head_dim, gqa_ratio):
    num_kv_heads = NUM_HEADS // gqa_ratio
    backend = TorchAttentionBackend(
        NUM_HEADS, num_kv_heads, head_dim, scale=head_dim**-0.5, block_size=block_size
    )
    batch = BATCHES[batch_name]
    (query, key, value, cache), metadata, contexts = _build_case(
        batch, num_kv_heads, head_dim, block_size
    )
    assert cache.shape == backend.kv_cache_shape(cache.shape[1])

    out = backend.forward(query, key, value, cache, metadata)

    assert out.shape == query.shape
    expected = torch.cat([naive_attention(q, k, v, backend.scale) for q, k, v in contexts])
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


def test_writes_new_keys_and_values_to_their_slots():
    block_size, num_kv_heads, head_dim = 16, 2, 32
    backend = TorchAttentionBackend(8, num_kv_heads, head_dim, 1.0, block_size)
    (query, key, value, cache), metadata, _ = _build_case(
        BATCHES["mixed"], num_kv_heads, head_dim, block_size
    )
    backend.forward(query, key, value, cache, metadata)
    flat = cache.view(2, -1, num_kv_heads, head_dim)
    torch.testing.assert_close(flat[0, metadata.slot_mapping], key, rtol=0, atol=0)
    torch.testing.assert_close(flat[1, metadata.slot_mapping], value, rtol=0, atol=0)


def test_decode_ignores_stale_cache_beyond_seq_len():
    """Slots past a sequence's length hold garbage (here: huge values) that must not leak."""
    block_size, num_kv_heads, head_dim = 16, 4, 32
    backend = TorchAttentionBackend(8, num_kv_heads, head_dim, head_dim**-0.5, block_size)
    batch = [(1, 5), (1, 20)]
    (query, key, value, cache), metadata, contexts = _build_case(
        batch, num_kv_heads, head_dim, block_size
    )
    poisoned = cache.clone()
    for i, (_, seq_len) in enumerate(batch):
        block = metadata.block_tables[i, (seq_len - 1) // block_size]
        poisoned[:, block, (seq_len - 1) % block_size + 1 :] = 1e4
    out = backend.forward(query, key, value, poisoned, metadata)
    expected = torch.cat([naive_attention(q, k, v, backend.scale) for q, k, v in contexts])
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


def test_bfloat16_close_to_float32():
    block_size, num_kv_heads, head_dim = 16, 2, 64
    backend = TorchAttentionBackend(8, num_kv_heads, head_dim, head_dim**-0.5, block_size)
    (query, key, value, cache), metadata, contexts = _build_case(
        BATCHES["mixed"], num_kv_heads, head_dim, block_size
    )
    out = backend.forward(
        query.bfloat16(), key.bfloat16(), value.bfloat16(), cache.bfloat16(), metadata
    )
    assert out.dtype == torch.bfloat16
    expected = torch.cat([naive_attention(q, k, v, backend.scale) for q, k, v in contexts])
    torch.testing.assert_close(out.double(), expected, atol=3e-2, rtol=3e-2)


def test_registers_as_torch():
    registered = {}
    register_attention_backends(lambda name, cls: registered.__setitem__(name, cls))
    assert registered == {"torch": TorchAttentionBackend}
