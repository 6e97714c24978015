"""Decode products with activations quantized to int8 (``int8_activations.h``).

The weights are the file's values; only the activations multiplying them are rounded, to
``d * round(x / d)`` per 32 values with ``d = max |x| / 127``, and a type's offsets (its
minimums) multiply the exact activations. So a product must equal that computation in
float64 up to float32 sums, and each row's result must not depend on the batch it is in.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from vlite.kernels import native
from vlite.kernels.native import BLOCK_LAYOUTS, gguf_block_kernels
from vlite.testing.tiny_gguf import random_quantized_matrix

INT8_TYPES = sorted(set(BLOCK_LAYOUTS) - {"F16", "BF16"})


#: Per type with an offset (a minimum): the byte ranges of a block holding its quantized
#: values. With them zeroed a block decodes to its offsets alone.
QUANT_BYTES = {
    "Q4_1": slice(4, 20),
    "Q5_1": slice(4, 24),
    "Q2_K": slice(16, 80),
    "Q4_K": slice(16, 144),
    "Q5_K": slice(16, 176),
}


def _values(qtype: str, raw: np.ndarray, rows: int, cols: int) -> torch.Tensor:
    values = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype]).astype(np.float64)
    return torch.from_numpy(values.reshape(rows, cols))


def matrix(qtype: str, rows: int, blocks_per_row: int, seed: int = 0):
    """``(blocks, the file's values [rows, cols], their offsets [rows, cols], cols)`` of a
    random matrix (float64; the offsets are 0 for types without a minimum)."""
    layout = BLOCK_LAYOUTS[qtype]
    cols = blocks_per_row * layout.values
    raw = random_quantized_matrix(qtype, rows, cols, np.random.default_rng(seed))
    offsets = torch.zeros(rows, cols, dtype=torch.float64)
    if qtype in QUANT_BYTES:
        zeroed = raw.copy().reshape(rows, blocks_per_row, layout.nbytes)
        zeroed[..., QUANT_BYTES[qtype]] = 0
        offsets = _values(qtype, zeroed.reshape(raw.shape), rows, cols)
    return torch.from_numpy(raw.copy()), _values(qtype, raw, rows, cols), offsets, cols


def rounded_activations(x: torch.Tensor, digits: int) -> torch.Tensor:
    """``x`` ``[M, K]`` as the kernels round it, per 32 values with ``d = max |x| / 127``
    (in float32, as the kernel computes it): ``d * round(x / d)``, plus with a second digit
    ``d / 254 * round(254 * left / d)`` of what is left."""
    blocks = x.reshape(x.shape[0], -1, 32)
    largest = blocks.abs().amax(-1, keepdim=True)
    inverse = torch.where(largest > 0, 127.0 / largest, torch.zeros_like(largest))
    scale = largest / 127.0
    high = torch.round(blocks * inverse)
    rounded = high.double() * scale.double()
    if digits == 2:
        low = torch.round((blocks - high * scale) * (254.0 * inverse))
        rounded = rounded + low.double() * (scale.double() / 254.0)
    return rounded.reshape(x.shape)


def assert_exact_up_to_float32_sums(got, x, weights, offsets, digits) -> None:
    """``got`` = ``(W - B) @ rounded x + B @ x`` (``B``: the offsets, which multiply the
    exact activations) up to float32 summation error."""
    expected = rounded_activations(x, digits) @ (weights - offsets).t() + x.double() @ offsets.t()
    magnitude = x.double().abs() @ weights.abs().t() + x.double().abs() @ offsets.abs().t()
    assert got.shape == expected.shape
    error = (got.double() - expected).abs()
    assert bool((error <= 1e-5 * magnitude + 1e-6).all()), float(error.max())
    # the rounding the kernel made shows: the float32 product differs by far more
    exact = x.double() @ weights.t()
    assert float((exact - expected).abs().max()) > 10 * float(error.max())


@pytest.fixture(scope="module")
def kernels():
    kernels = gguf_block_kernels()
    if not kernels.has_int8("Q4_0"):
        pytest.skip("the int8 kernels need AVX2 (this build has none)")
    return kernels


@pytest.mark.parametrize("qtype", INT8_TYPES)
@pytest.mark.parametrize("digits", [1, 2])
@pytest.mark.parametrize("num_rows", [1, 2, 5])
def test_products_are_the_files_weights_times_rounded_activations(kernels, qtype, digits, num_rows):
    blocks, weights, offsets, cols = matrix(qtype, 37, 2, seed=12)
    x = torch.randn(num_rows, cols, generator=torch.Generator().manual_seed(13))
    x[:, 5] = 9.0  # an outlier: its block's other values round coarsely
    got = kernels.product(qtype, blocks, 37, cols, digits)(x)
    assert_exact_up_to_float32_sums(got, x, weights, offsets, digits)


@pytest.mark.parametrize("qtype", INT8_TYPES)
@pytest.mark.parametrize("digits", [1, 2])
def test_a_row_gives_the_same_bits_alone_or_in_any_batch(kernels, qtype, digits):
    blocks, _, _, cols = matrix(qtype, 37, 2, seed=14)
    x = torch.randn(native.GEMM_ROWS - 1, cols, generator=torch.Generator().manual_seed(15))
    product = kernels.product(qtype, blocks, 37, cols, digits)
    alone = torch.cat([product(x[i : i + 1]) for i in range(len(x))])
    for rows in (2, 3, 5, len(x)):
        assert torch.equal(product(x[:rows]), alone[:rows]), rows


def test_zero_rows_and_float_types_keep_the_float_path(kernels):
    q_blocks, _, _, q_cols = matrix("Q4_K", 5, 1)
    with pytest.raises(ValueError, match="activation_digits=3"):
        kernels.product("Q4_K", q_blocks, 5, q_cols, activation_digits=3)
    blocks, _, _, cols = matrix("F16", 5, 1)
    x = torch.randn(2, cols, generator=torch.Generator().manual_seed(1))
    exact = kernels.product("F16", blocks, 5, cols)(x)
    assert not kernels.has_int8("F16")
    assert torch.equal(kernels.product("F16", blocks, 5, cols, activation_digits=2)(x), exact)
    empty = torch.empty(0, q_cols)
    product = kernels.product("Q4_K", q_blocks, 5, q_cols, activation_digits=2)
    assert product(empty).shape == (0, 5)


def test_many_rows_keep_float32_activations(kernels):
    blocks, _, _, cols = matrix("Q6_K", 9, 1, seed=3)
    x = torch.randn(native.GEMM_ROWS, cols, generator=torch.Generator().manual_seed(4))
    int8 = kernels.product("Q6_K", blocks, 9, cols, activation_digits=2)(x)
    assert torch.equal(int8, kernels.product("Q6_K", blocks, 9, cols)(x))
