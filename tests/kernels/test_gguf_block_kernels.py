"""The GGUF block kernels compute with exactly the file's values; the plan and its errors."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from vlite.core.config import VliteConfig
from vlite.kernels.native import gguf_block_kernels
from vlite.models.quantization import (
    BlockQuantizedTensor,
    QuantizedMatrix,
    concat_rows,
    plan_quantization,
)

QTYPES = ("Q4_0", "Q4_1", "Q8_0")
CPU = torch.device("cpu")


def quantized(qtype: str, rows: int, cols: int, seed: int = 0):
    """``(BlockQuantizedTensor, the values gguf-py dequantizes it to)`` of random weights."""
    values = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    kind = gguf.GGMLQuantizationType[qtype]
    blocks = gguf.quants.quantize(values, kind)
    reference = torch.from_numpy(gguf.quants.dequantize(blocks, kind).astype(np.float32))
    return BlockQuantizedTensor(qtype, torch.from_numpy(blocks.copy()), cols), reference


@pytest.mark.parametrize("qtype", QTYPES)
def test_dequantize_equals_gguf_py_exactly(qtype):
    tensor, reference = quantized(qtype, 50, 96)
    assert torch.equal(tensor.dequantize(), reference)


@pytest.mark.parametrize("qtype", QTYPES)
def test_the_product_uses_exactly_the_dequantized_values(qtype):
    # x = I picks single weights out: any rounding of a dequantized value would show.
    # 96 rows of x are three strips of the blocked GEMM; 50 output rows end in a part panel.
    tensor, reference = quantized(qtype, 50, 96)
    product = gguf_block_kernels().matmul(qtype, torch.eye(96), tensor.blocks, 50)
    assert torch.equal(product, reference.T)


@pytest.mark.parametrize("qtype", QTYPES)
# 1-9 rows: the decode tiles (up to 8 in one pass); 33 and 70: GEMM strips of 32 plus rows
# left to the tiles.
@pytest.mark.parametrize("num_rows", [1, 2, 3, 5, 6, 7, 8, 9, 33, 70])
def test_products_match_float64(qtype, num_rows):
    tensor, reference = quantized(qtype, 37, 160, seed=num_rows)
    x = torch.randn(num_rows, 160, generator=torch.Generator().manual_seed(1))
    out = QuantizedMatrix(tensor).matmul(x)
    expected = (x.double() @ reference.double().T).float()
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


def test_bfloat16_inputs_come_back_in_bfloat16():
    tensor, reference = quantized("Q4_1", 8, 64)
    out = QuantizedMatrix(tensor).matmul(torch.ones(2, 64, dtype=torch.bfloat16))
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), reference.sum(1).expand(2, 8), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("qtype", QTYPES)
def test_row_gather_is_an_embedding_lookup(qtype):
    tensor, reference = quantized(qtype, 20, 64)
    ids = torch.tensor([3, 0, 19, 3])
    assert torch.equal(QuantizedMatrix(tensor).rows(ids, torch.float32), reference[ids])


def test_narrow_keeps_whole_rows_and_whole_blocks():
    tensor, reference = quantized("Q4_1", 10, 128)
    assert torch.equal(tensor.narrow(0, 2, 5).dequantize(), reference[2:7])
    assert torch.equal(tensor.narrow(1, 32, 64).dequantize(), reference[:, 32:96])
    with pytest.raises(ValueError, match="do not fall on 32-value Q4_1 blocks"):
        tensor.narrow(1, 16, 32)


def test_concat_rows_needs_one_type():
    a, ra = quantized("Q4_1", 4, 64)
    b, rb = quantized("Q4_1", 6, 64, seed=1)
    assert torch.equal(concat_rows([a, b]).dequantize(), torch.cat([ra, rb]))
    assert concat_rows([a, quantized("Q8_0", 2, 64)[0]]) is None


def test_plan_keeps_kernel_types_and_names_the_rest():
    plan = plan_quantization("auto", ["F32", "Q4_1", "Q4_1", "Q8_0", "IQ2_XXS"], CPU)
    assert plan.kept == {"Q4_1": 2, "Q8_0": 1} and plan.dequantized == {"IQ2_XXS": 1}
    line = plan.describe(torch.float32)
    assert "Q4_1 x2, Q8_0 x1 kept" in line and "IQ2_XXS x1 dequantized to float32" in line


@pytest.mark.parametrize(
    ("setting", "types", "device", "why"),
    [
        ("none", ["Q4_1"], CPU, "quantization='none'"),
        ("auto", ["Q4_1"], torch.device("cuda"), "run on the CPU, not cuda"),
        ("auto", None, CPU, "not a GGUF file"),
        ("auto", ["F32", "F64"], CPU, "holds no quantized tensor"),
    ],
)
def test_plan_says_why_nothing_is_kept(setting, types, device, why):
    plan = plan_quantization(setting, types, device)
    assert not plan.kept and why in plan.describe(torch.float32)


def test_unknown_quantization_is_an_error_naming_the_choices():
    with pytest.raises(ValueError, match=r"quantization='int3'.*\('auto', 'gguf', 'none'\)"):
        plan_quantization("int3", ["Q4_1"], CPU)
    with pytest.raises(ValueError, match="quantization"):
        VliteConfig(quantization="int3")


def test_cpu_threads_must_be_positive():
    with pytest.raises(ValueError, match="cpu_threads"):
        VliteConfig(cpu_threads=0)


@pytest.mark.parametrize(
    ("types", "device", "why"),
    [
        (None, CPU, "not a GGUF file"),
        (["IQ2_XXS", "F32"], CPU, r"no tensor of a type with a kernel \(IQ2_XXS\)"),
        (["Q4_1"], torch.device("cuda"), "not cuda"),
    ],
)
def test_gguf_insists_and_says_why_it_cannot(types, device, why):
    with pytest.raises(ValueError, match=f"quantization='gguf'.*{why}"):
        plan_quantization("gguf", types, device)
    assert plan_quantization("gguf", ["Q4_1", "F32"], CPU).kept == {"Q4_1": 1}
