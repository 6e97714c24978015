"""Decode products with activations quantized to integers (``quantized_activations.h``).

The weights are the file's values; only the activations multiplying them are rounded, to
``d * round(x / d)`` per 32 values with ``d = max |x| / 127`` (int8) or ``max |x| / 32258``
(int16), and a type's offsets (its minimums; at int16 also Q4_0's and Q5_0's - 8 d and
- 16 d) multiply the exact activations. So a product must equal that computation in
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

QUANTIZED_TYPES = sorted(set(BLOCK_LAYOUTS) - {"F16", "BF16"})


#: Per type with an offset (a minimum), per precision: the byte ranges of a block holding
#: its quantized values. With them zeroed a block decodes to its offsets alone.
QUANT_BYTES = {
    "Q4_1": slice(4, 20),
    "Q5_1": slice(4, 24),
    "Q2_K": slice(16, 80),
    "Q4_K": slice(16, 144),
    "Q5_K": slice(16, 176),
}
QUANT_BYTES_AT = {
    "int8": QUANT_BYTES,
    "int16": {**QUANT_BYTES, "Q4_0": slice(2, 18), "Q5_0": slice(2, 22)},
}


def _values(qtype: str, raw: np.ndarray, rows: int, cols: int) -> torch.Tensor:
    values = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype]).astype(np.float64)
    return torch.from_numpy(values.reshape(rows, cols))


def matrix(qtype: str, rows: int, blocks_per_row: int, seed: int = 0, activations="int8"):
    """``(blocks, the file's values [rows, cols], their offsets [rows, cols], cols)`` of a
    random matrix (float64; the offsets are 0 for types without a minimum at that
    precision)."""
    layout = BLOCK_LAYOUTS[qtype]
    cols = blocks_per_row * layout.values
    raw = random_quantized_matrix(qtype, rows, cols, np.random.default_rng(seed))
    offsets = torch.zeros(rows, cols, dtype=torch.float64)
    quant_bytes = QUANT_BYTES_AT[activations]
    if qtype in quant_bytes:
        zeroed = raw.copy().reshape(rows, blocks_per_row, layout.nbytes)
        zeroed[..., quant_bytes[qtype]] = 0
        offsets = _values(qtype, zeroed.reshape(raw.shape), rows, cols)
    return torch.from_numpy(raw.copy()), _values(qtype, raw, rows, cols), offsets, cols


def rounded_activations(x: torch.Tensor, activations: str) -> torch.Tensor:
    """``x`` ``[M, K]`` as the kernels round it, per 32 values with ``d = max |x| / 127``
    (int8) or ``max |x| / 32258`` (int16), in float32 as the kernel computes it:
    ``d * round(x / d)``."""
    levels = {"int8": 127.0, "int16": 32258.0}[activations]
    blocks = x.reshape(x.shape[0], -1, 32)
    largest = blocks.abs().amax(-1, keepdim=True)
    inverse = torch.where(largest > 0, levels / largest, torch.zeros_like(largest))
    rounded = torch.round(blocks * inverse).double() * (largest / levels).double()
    return rounded.reshape(x.shape)


def assert_exact_up_to_float32_sums(got, x, weights, offsets, activations) -> None:
    """``got`` = ``(W - B) @ rounded x + B @ x`` (``B``: the offsets, which multiply the
    exact activations) up to float32 summation error."""
    rounded = rounded_activations(x, activations)
    expected = rounded @ (weights - offsets).t() + x.double() @ offsets.t()
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
    if not kernels.has_quantized_activations("Q4_0"):
        pytest.skip("the integer kernels need AVX2 (this build has none)")
    return kernels


@pytest.mark.parametrize("qtype", QUANTIZED_TYPES)
@pytest.mark.parametrize("activations", ["int8", "int16"])
@pytest.mark.parametrize("num_rows", [1, 2, 5])
def test_products_are_the_files_weights_times_rounded_activations(
    kernels, qtype, activations, num_rows
):
    blocks, weights, offsets, cols = matrix(qtype, 37, 2, seed=12, activations=activations)
    x = torch.randn(num_rows, cols, generator=torch.Generator().manual_seed(13))
    x[:, 5] = 9.0  # an outlier: its block's other values round coarsely
    got = kernels.product(qtype, blocks, 37, cols, activations)(x)
    assert_exact_up_to_float32_sums(got, x, weights, offsets, activations)


@pytest.mark.parametrize("qtype", QUANTIZED_TYPES)
@pytest.mark.parametrize("activations", ["int8", "int16", "float32"])
def test_a_row_gives_the_same_bits_alone_or_in_any_batch(kernels, qtype, activations):
    blocks, _, _, cols = matrix(qtype, 37, 2, seed=14)
    # below the panels: the GEMM's rows (float32), or the quantized tiles' own row count
    num_rows = tile_rows(kernels, qtype, activations) - 1
    x = torch.randn(num_rows, cols, generator=torch.Generator().manual_seed(15))
    product = kernels.product(qtype, blocks, 37, cols, activations)
    alone = torch.cat([product(x[i : i + 1]) for i in range(len(x))])
    for rows in sorted({2, 3, 5, 7, 8, len(x)} & set(range(2, len(x) + 1))):
        assert torch.equal(product(x[:rows]), alone[:rows]), rows


def tile_rows(kernels, qtype: str, activations: str) -> int:
    """Rows from which products of ``qtype`` leave the batch-invariant tiles."""
    if activations == "float32":
        return native.GEMM_ROWS
    if activations == "int16" and kernels.int16_gemm_rows(qtype):
        return kernels.int16_gemm_rows(qtype)
    return kernels.quantized_rows(qtype)


@pytest.mark.parametrize("qtype", QUANTIZED_TYPES)
def test_the_int16_gemm_gives_a_row_the_same_bits_in_any_batch_it_takes(kernels, qtype):
    gemm_rows = kernels.int16_gemm_rows(qtype)
    blocks, weights, offsets, cols = matrix(qtype, 37, 2, seed=16, activations="int16")
    x = torch.randn(
        max(tile_rows(kernels, qtype, "int16"), native.GEMM_ROWS) + 9,
        cols,
        generator=torch.Generator().manual_seed(17),
    )
    x[:, 5] = 40.0  # an outlier: its block's other values round coarsely enough to show
    product = kernels.product(qtype, blocks, 37, cols, "int16")
    got = product(x)
    if not gemm_rows:  # no GEMM in this build: the many rows took the float32 panels
        assert torch.equal(got, kernels.product(qtype, blocks, 37, cols)(x))
        return
    assert_exact_up_to_float32_sums(got, x, weights, offsets, "int16")
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(18))
    assert torch.equal(product(x[order]), got[order])
    assert torch.equal(product(x[:gemm_rows]), got[:gemm_rows])
    below = product(x[: gemm_rows - 1])
    if kernels.int16_matches_gemm(qtype):  # the tiles compute as the GEMM does
        assert torch.equal(below, got[: gemm_rows - 1])
        for rows in (1, 2, 5):
            assert torch.equal(product(x[order[:rows]]), got[order[:rows]]), rows
    else:  # below its rows the tiles sum in their own order: other bits, the same values
        assert not torch.equal(below, got[: gemm_rows - 1])


def test_the_32_value_types_compute_as_the_gemm_does(kernels):
    matching = {qtype for qtype in QUANTIZED_TYPES if kernels.int16_matches_gemm(qtype)}
    if kernels.int16_gemm_rows("Q4_1"):  # an AVX-512 VNNI build
        assert matching == {q for q in QUANTIZED_TYPES if BLOCK_LAYOUTS[q].values == 32}
    else:
        assert matching == set()


def test_zero_rows_and_float_types_keep_the_float_path(kernels):
    q_blocks, _, _, q_cols = matrix("Q4_K", 5, 1)
    with pytest.raises(ValueError, match="activations='int4'"):
        kernels.product("Q4_K", q_blocks, 5, q_cols, activations="int4")
    blocks, _, _, cols = matrix("F16", 5, 1)
    x = torch.randn(2, cols, generator=torch.Generator().manual_seed(1))
    exact = kernels.product("F16", blocks, 5, cols)(x)
    assert not kernels.has_quantized_activations("F16")
    assert torch.equal(kernels.product("F16", blocks, 5, cols, activations="int16")(x), exact)
    empty = torch.empty(0, q_cols)
    product = kernels.product("Q4_K", q_blocks, 5, q_cols, activations="int16")
    assert product(empty).shape == (0, 5)


@pytest.mark.parametrize("qtype", ["Q6_K", "Q4_0"])
def test_many_rows_of_int8_keep_float32_activations(kernels, qtype):
    blocks, _, _, cols = matrix(qtype, 9, 1, seed=3)
    num_rows = kernels.quantized_rows(qtype)
    x = torch.randn(num_rows, cols, generator=torch.Generator().manual_seed(4))
    quantized = kernels.product(qtype, blocks, 9, cols, activations="int8")(x)
    assert torch.equal(quantized, kernels.product(qtype, blocks, 9, cols)(x))
    assert not torch.equal(quantized[:1], kernels.product(qtype, blocks, 9, cols, "int8")(x[:1]))


def test_the_256_value_types_keep_int8_tiles_up_to_their_own_row_count(kernels):
    assert kernels.quantized_rows("Q4_K") > kernels.quantized_rows("Q5_0") >= native.GEMM_ROWS
    blocks, weights, offsets, cols = matrix("Q4_K", 9, 1, seed=5, activations="int8")
    x = torch.randn(native.GEMM_ROWS + 8, cols, generator=torch.Generator().manual_seed(6))
    x[:, 5] = 9.0  # an outlier: its block's other values round coarsely
    product = kernels.product("Q4_K", blocks, 9, cols, "int8")
    # the rows' bits are those of the same rows alone: the quantized path, not the panels
    assert torch.equal(product(x), torch.cat([product(x[i : i + 1]) for i in range(len(x))]))
    assert_exact_up_to_float32_sums(product(x), x, weights, offsets, "int8")
