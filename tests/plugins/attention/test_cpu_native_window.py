"""The C kernel's sliding window on its two paths: 16 keys at a time with AVX-512 (8 with
AVX2) for head dims 32/64/128/256 (Gemma 3's 256), and one cache block at a time with scalar
dot products (other head dims)."""

from __future__ import annotations

import pytest
import torch

from vlite.plugins.attention.cpu_native import CpuAttentionBackend
from vlite.testing.attention_cases import AttentionShape, run_case


@pytest.mark.parametrize("head_dim", [32, 64, 128, 256, 48])
@pytest.mark.parametrize("window", [1, 13, 40])
def test_window_matches_dense_attention(head_dim, window):
    reason = CpuAttentionBackend.unavailable_reason(torch.device("cpu"), torch.float32)
    if reason is not None:
        pytest.skip(reason)  # no C compiler: the kernel cannot be built here
    shape = AttentionShape(head_dim, 2, 16)
    backend = CpuAttentionBackend(
        shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.scale, shape.block_size
    )
    batch = [(40, 30), (70, 1), (0, 9), (15, 1), (3, 50), (63, 2)]
    for result in run_case(backend, shape, batch, seed=window, sliding_window=window):
        torch.testing.assert_close(result.output.double(), result.expected, atol=1e-4, rtol=1e-4)
