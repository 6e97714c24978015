"""Every GGUF type the kernels keep: exactly gguf-py's values, in products of any shape.

The blocks are random bytes with finite fp16 scales, so every bit pattern of every field
is exercised (gguf-py cannot quantize to the K-quants or IQ4; its dequantization is the
reference for all types).
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from vlite.kernels import call_replay, native
from vlite.kernels.native import BLOCK_LAYOUTS, gguf_block_kernels
from vlite.testing.tiny_gguf import random_quantized_matrix

FLOAT_TYPES = ("F16", "BF16")
ALL_TYPES = sorted(BLOCK_LAYOUTS)


def random_blocks(qtype: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    return random_quantized_matrix(qtype, rows, cols, np.random.default_rng(seed))


def reference(qtype: str, blocks: np.ndarray, cols: int) -> torch.Tensor:
    kind = gguf.GGMLQuantizationType[qtype]
    values = gguf.quants.dequantize(blocks, kind).astype(np.float32)
    return torch.from_numpy(values.reshape(blocks.shape[0], cols))


def matrix(qtype: str, rows: int, blocks_per_row: int, seed: int = 0):
    cols = blocks_per_row * BLOCK_LAYOUTS[qtype].values
    raw = random_blocks(qtype, rows, cols, seed)
    return torch.from_numpy(raw.copy()), reference(qtype, raw, cols), cols


def assert_product_close(got: torch.Tensor, x: torch.Tensor, weights: torch.Tensor) -> None:
    """``got`` is ``x @ weights^T`` up to float32 summation error: within 1e-5 of the sum
    of the terms' magnitudes (the bound of a float32 sum of K terms, with room)."""
    expected = x.double() @ weights.double().t()
    magnitude = x.double().abs() @ weights.double().abs().t()
    assert got.shape == expected.shape
    assert bool(((got.double() - expected).abs() <= 1e-5 * magnitude + 1e-6).all())


@pytest.fixture(scope="module")
def kernels():
    return gguf_block_kernels()


@pytest.mark.parametrize("qtype", ALL_TYPES)
def test_decoding_equals_gguf_py_value_for_value(kernels, qtype):
    blocks, expected, cols = matrix(qtype, 7, 3)
    assert torch.equal(kernels.dequantize(qtype, blocks, cols), expected)


@pytest.mark.parametrize("qtype", ALL_TYPES)
def test_row_gather_is_an_embedding_lookup(kernels, qtype):
    blocks, expected, cols = matrix(qtype, 11, 2, seed=1)
    ids = torch.tensor([3, 0, 10, 3], dtype=torch.int64)
    assert torch.equal(kernels.gather_rows(qtype, blocks, cols, ids), expected[ids])


@pytest.mark.parametrize("qtype", ALL_TYPES)
@pytest.mark.parametrize("num_rows", [0, 1, 2, 3, 6, 33])
def test_products_of_odd_shapes_use_the_files_values(kernels, qtype, num_rows):
    # 37 rows of W: chunks of 16 and tiles of 4 with remainders; 33 rows of x: the
    # many-rows path (a GEMM, or panels for types without one) plus a remainder.
    blocks, weights, cols = matrix(qtype, 37, 2, seed=2)
    x = torch.randn(num_rows, cols, generator=torch.Generator().manual_seed(3))
    got = kernels.product(qtype, blocks, 37, cols)(x)
    assert got.shape == (num_rows, 37)
    assert_product_close(got, x, weights)


@pytest.mark.parametrize("qtype", ALL_TYPES)
def test_a_row_gives_the_same_bits_alone_or_in_any_batch_below_the_gemm(kernels, qtype):
    # The decode paths (register tiles for some types and row counts, the buffer path for
    # the rest) sum in one order, so batching never changes a row's result.
    blocks, _, cols = matrix(qtype, 37, 2, seed=8)
    x = torch.randn(native.GEMM_ROWS - 1, cols, generator=torch.Generator().manual_seed(9))
    product = kernels.product(qtype, blocks, 37, cols)
    alone = torch.cat([product(x[i : i + 1]) for i in range(len(x))])
    for rows in (2, 3, 4, 5, 9, len(x)):
        assert torch.equal(product(x[:rows]), alone[:rows]), rows


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K", "IQ4_NL"])
def test_the_many_rows_path_over_several_panels(kernels, qtype, monkeypatch):
    blocks, weights, cols = matrix(qtype, 40, 1, seed=4)
    x = torch.randn(native.GEMM_ROWS + 5, cols, generator=torch.Generator().manual_seed(5))
    monkeypatch.setattr(native, "PANEL_BYTES", 4 * cols * 16)  # 16 rows a panel: 3 panels
    got = kernels.product(qtype, blocks, 40, cols)(x)
    assert_product_close(got, x, weights)


@pytest.mark.parametrize("qtype", ["Q5_K", "Q3_K", "IQ4_XS"])
def test_a_row_not_a_multiple_of_the_block_is_refused_naming_it(kernels, qtype):
    values = BLOCK_LAYOUTS[qtype].values
    blocks = torch.zeros(4, BLOCK_LAYOUTS[qtype].nbytes, dtype=torch.uint8)
    with pytest.raises(ValueError, match=f"{qtype} blocks of a \\[4, {values + 32}\\] matrix"):
        kernels.product(qtype, blocks, 4, values + 32)


def test_every_layout_matches_gguf_py():
    for name, layout in BLOCK_LAYOUTS.items():
        kind = gguf.GGMLQuantizationType[name]
        values, nbytes = gguf.GGML_QUANT_SIZES[kind]
        if name in FLOAT_TYPES:  # read 32 values at a time
            assert (values * 32, nbytes * 32) == (layout.values, layout.nbytes)
        else:
            assert (values, nbytes) == (layout.values, layout.nbytes)


def _cpu_has(flag: str) -> bool:
    from pathlib import Path

    text = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    return any(line.startswith("flags") and flag in line.split() for line in text.splitlines())


#: Each code path of gguf_blocks.c, built for a CPU that has (only) its features; a path runs
#: where this machine has them.
ISA_BUILDS = {
    "portable": ("-march=x86-64", None),
    "avx2": ("-march=haswell", "avx2"),
    "avx512": ("-march=skylake-avx512", "avx512f"),
    "avx512_vnni": ("-march=cascadelake", "avx512_vnni"),
}


def _isa_flags(isa: str) -> tuple[str, ...]:
    return tuple(ISA_BUILDS[isa][0] if flag == "-march=native" else flag for flag in native.FLAGS)


@pytest.mark.parametrize("isa", sorted(ISA_BUILDS))
@pytest.mark.parametrize(
    "source",
    [native.SOURCE, native.FUSED_OPS_SOURCE, native.PAGED_ATTENTION_SOURCE, call_replay.SOURCE],
    ids=lambda path: path.stem,
)
def test_every_kernel_source_compiles_for_every_vector_path(isa, source):
    """Compiling needs no CPU feature: a path this machine cannot run still has to build,
    because the kernels are compiled with ``-march=native`` on whatever host runs them."""
    import platform

    if platform.machine() != "x86_64":
        pytest.skip("the -march values are x86-64's")
    assert native.build_library(source, _isa_flags(isa)).exists()


@pytest.mark.parametrize("isa", sorted(ISA_BUILDS))
def test_every_vector_path_decodes_and_multiplies_exactly(isa):
    import platform

    feature = ISA_BUILDS[isa][1]
    if platform.machine() != "x86_64" or (feature is not None and not _cpu_has(feature)):
        pytest.skip(f"this CPU cannot run the {isa} build")
    kernels = native.GGUFBlockKernels(native.build_library(native.SOURCE, _isa_flags(isa)))
    for qtype in ALL_TYPES:
        blocks, weights, cols = matrix(qtype, 21, 2, seed=6)
        assert torch.equal(kernels.dequantize(qtype, blocks, cols), weights), qtype
        for num_rows in (1, 2, 5, native.GEMM_ROWS + 1):
            x = torch.randn(num_rows, cols, generator=torch.Generator().manual_seed(7))
            assert_product_close(kernels.product(qtype, blocks, 21, cols)(x), x, weights)


@pytest.mark.parametrize("isa", ["avx2", "avx512", "avx512_vnni"])
def test_every_vector_path_multiplies_the_32_value_types_with_the_gemms_bits(isa):
    """The 32-value types' int16 tiles compute with the int16 GEMM's arithmetic on every
    build that has them (AVX2 and up, with or without VNNI), so another build's products
    have this build's bits, whichever of its tiles, row lanes or GEMM took them."""
    import platform

    native_kernels = gguf_block_kernels()
    feature = ISA_BUILDS[isa][1]
    if platform.machine() != "x86_64" or not _cpu_has(feature):
        pytest.skip(f"this CPU cannot run the {isa} build")
    if not native_kernels.int16_matches_gemm("Q4_1"):
        pytest.skip("this machine's build has no int16 GEMM to compare with")
    kernels = native.GGUFBlockKernels(native.build_library(native.SOURCE, _isa_flags(isa)))
    for qtype in (q for q in ALL_TYPES if BLOCK_LAYOUTS[q].values == 32 and "F" not in q):
        blocks, _, cols = matrix(qtype, 37, 2, seed=8)
        for num_rows in (1, 2, 5, 13):
            x = torch.randn(num_rows, cols, generator=torch.Generator().manual_seed(num_rows))
            got = kernels.product(qtype, blocks, 37, cols, "int16")(x)
            expected = native_kernels.product(qtype, blocks, 37, cols, "int16")(x)
            assert torch.equal(got, expected), (qtype, num_rows)
