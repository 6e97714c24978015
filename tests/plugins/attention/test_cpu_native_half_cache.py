"""The C kernel over a float16 KV cache (``kv_cache_dtype``): keys and values are rounded to
float16 as PyTorch rounds them (to nearest, ties to even) on every vector path, including
the portable build's integer conversions, and attention over them matches the reference
fed the same rounded keys and values."""

from __future__ import annotations

import platform

import pytest
import torch

from vlite.kernels import native
from vlite.plugins.attention.cpu_native import CpuAttentionBackend
from vlite.testing.attention_cases import AttentionShape, run_case

#: float32 values whose float16 rounding is easy to get wrong: ties (to even, up and down),
#: the largest finite value and what rounds past it, subnormals and their ties, the smallest
#: subnormal's half, signed zero, infinities and NaN.
HARD_VALUES = [
    1.0 + 2**-11,  # a tie: rounds down to even
    1.0 + 3 * 2**-11,  # a tie: rounds up to even
    1.0 + 2**-11 + 2**-20,  # just above a tie
    65504.0,
    65519.0,  # rounds down to 65504
    65520.0,  # rounds to infinity
    1e6,
    2**-14,  # the smallest normal
    2**-14 - 2**-25,  # a subnormal tie that rounds up into the smallest normal
    3 * 2**-25,  # a subnormal tie: 1.5 ulps rounds to 2
    2**-25,  # half the smallest subnormal: ties to zero
    2**-25 + 2**-35,  # just above: the smallest subnormal
    1e-10,
    0.0,
    -0.0,
    float("inf"),
    float("-inf"),
    -1.0 - 2**-11,
    123.456,
]


def _kernel(flags: tuple[str, ...] | None) -> native.PagedAttentionKernel:
    if flags is None:
        reason = native.unavailable_reason()
        if reason is not None:
            pytest.skip(reason)  # no C compiler here
        return native.paged_attention_kernel()
    if platform.machine() != "x86_64":
        pytest.skip("the -march values are x86-64's")
    return native.PagedAttentionKernel(native.build_library(native.PAGED_ATTENTION_SOURCE, flags))


def _portable_flags() -> tuple[str, ...]:
    """The kernel built for any x86-64 (no F16C: the integer conversions)."""
    return tuple("-march=x86-64" if flag == "-march=native" else flag for flag in native.FLAGS)


def _write(kernel, rows: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """Writes ``rows`` [T, 1, D] as the keys and values of T one-token sequences, token t at
    slot t; returns the key cache's first T slots [T, D]."""
    num_tokens, _, head_dim = rows.shape
    kv_cache = torch.zeros(2, -(-num_tokens // 16), 16, 1, head_dim, dtype=cache_dtype)
    slots = torch.arange(num_tokens, dtype=torch.int64)
    step = kernel.step(
        slots,
        (slots // 16).to(torch.int32)[:, None].contiguous(),  # each sequence's one block
        (slots % 16 + 1).to(torch.int32),  # it sees the keys of its block up to its own
        torch.arange(num_tokens + 1, dtype=torch.int32),
        1.0,
    )
    step(torch.zeros(num_tokens, 1, head_dim), rows, rows.clone(), kv_cache)
    return kv_cache[0].reshape(-1, head_dim)[:num_tokens]


@pytest.mark.parametrize("build", ["native", "portable"])
@pytest.mark.parametrize("head_dim", [64, 36])  # 8 at a time, and a scalar tail
def test_the_cache_holds_pytorch_s_float16_rounding(build, head_dim):
    kernel = _kernel(None if build == "native" else _portable_flags())
    gen = torch.Generator().manual_seed(head_dim)
    values = torch.tensor(HARD_VALUES)
    rows = torch.cat([values, -values, torch.randn(200, generator=gen) * 300])
    rows = torch.cat([rows, torch.tensor([float("nan")])])
    rows = torch.nn.functional.pad(rows, (0, -len(rows) % head_dim)).view(-1, 1, head_dim)
    written = _write(kernel, rows, torch.float16)
    expected = rows.view(-1, head_dim).half()
    number = ~expected.isnan()
    assert torch.equal(written.view(torch.int16)[number], expected.view(torch.int16)[number])
    assert written[~number].isnan().all()


@pytest.mark.parametrize("build", ["native", "portable"])
@pytest.mark.parametrize("head_dim", [32, 64, 128, 256, 48])
@pytest.mark.parametrize("window", [None, 13])
def test_attention_over_a_float16_cache_matches_the_reference(build, head_dim, window):
    kernel = _kernel(None if build == "native" else _portable_flags())
    shape = AttentionShape(head_dim, 3, 16)
    backend = CpuAttentionBackend(
        shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.scale, shape.block_size
    )
    backend._kernel = kernel
    batch = [(40, 30), (70, 1), (0, 9), (15, 1), (3, 50), (63, 2)]
    results = run_case(
        backend, shape, batch, seed=head_dim, sliding_window=window, cache_dtype=torch.float16
    )
    for result in results:
        torch.testing.assert_close(result.output.double(), result.expected, atol=1e-4, rtol=1e-4)


def test_a_float16_cache_is_not_read_as_float32():
    """The reference on unrounded keys differs measurably from the float16 cache's result,
    so the comparison above tells the cache's precision apart."""
    kernel = _kernel(None)
    shape = AttentionShape(64, 3, 16)
    backend = CpuAttentionBackend(
        shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.scale, shape.block_size
    )
    backend._kernel = kernel
    half = run_case(backend, shape, [(70, 3)], seed=1, cache_dtype=torch.float16)
    full = run_case(backend, shape, [(70, 3)], seed=1)
    assert not torch.allclose(half[-1].output, full[-1].output, atol=1e-5, rtol=1e-5)
