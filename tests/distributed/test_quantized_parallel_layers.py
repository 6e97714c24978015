"""Quantized weights in the tensor-parallel layers, checked in one process: each rank's
share is cut by the weight format (rows anywhere, columns on whole blocks of the type, any
block size), and the ranks' outputs combine to the product of the whole matrix's
dequantized values; a rank whose columns would split a block dequantizes instead."""

from __future__ import annotations

import pytest
import torch

from vlite.kernels.native import BLOCK_LAYOUTS
from vlite.models.mixed_pieces import MixedPieces
from vlite.models.parallel_layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabEmbedding,
    VocabParallelLMHead,
)
from vlite.plugins.weight_formats.gguf import GGUF_FORMAT
from vlite.testing.local_ranks import ranks
from vlite.worker.cpu_graphs import NativeCallCapturer

#: A 32-value type, and a 256-value one when the kernels have one.
TYPES = ["Q8_0"] + [t for t in ("Q4_K",) if t in BLOCK_LAYOUTS]


def quantized(qtype: str, rows: int, blocks_per_row: int, seed: int = 0):
    """``(weight, its float32 values)``: random stored bytes (every float field finite)."""
    layout = BLOCK_LAYOUTS[qtype]
    generator = torch.Generator().manual_seed(seed)
    data = torch.randint(
        0, 0x3C, (rows, blocks_per_row * layout.nbytes), generator=generator, dtype=torch.uint8
    )
    weight = GGUF_FORMAT.load(qtype, data, (rows, blocks_per_row * layout.values))
    return weight, weight.dequantize()


def close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    scale = expected.abs().max().item() + 1.0
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5 * scale)


@pytest.mark.parametrize("qtype", TYPES)
def test_column_parallel_keeps_each_ranks_rows_of_every_piece(qtype):
    sizes = {"q": 8, "k": 4, "v": 4}
    pieces = {
        name: quantized(qtype, size, 2, seed) for seed, (name, size) in enumerate(sizes.items())
    }
    cols = pieces["q"][0].shape[1]
    x = torch.randn(3, cols, generator=torch.Generator().manual_seed(1))
    outputs = []
    for group in ranks(2):
        layer = ColumnParallelLinear(cols, sizes, bias=False, tp_group=group)
        for name, (weight, _) in pieces.items():
            layer.load_full("weight", weight, name)
        assert layer.weight is None and layer.quantized is not None
        assert layer.quantized.nbytes == layer.quantized.blocks.numel()
        outputs.append(layer(x).split([s // 2 for s in sizes.values()], dim=-1))
    for index, (_, values) in enumerate(pieces.values()):
        close(torch.cat([out[index] for out in outputs], -1), x @ values.T)


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("world_size", [2, 4])
def test_row_parallel_keeps_whole_blocks_and_dequantizes_a_split_block(qtype, world_size):
    weight, values = quantized(qtype, 6, 2)  # two blocks per row
    cols = values.shape[1]
    x = torch.randn(3, cols, generator=torch.Generator().manual_seed(2))
    total = torch.zeros(3, 6)
    for group in ranks(world_size):
        layer = RowParallelLinear(cols, 6, bias=False, tp_group=group)
        layer.load_full("weight", weight)
        splits_a_block = cols // world_size % BLOCK_LAYOUTS[qtype].values != 0
        assert (layer.quantized is None) == splits_a_block, (qtype, world_size)
        start, end = group.shard_range(cols)
        total += layer(x[:, start:end])
    close(total, x @ values.T)


def test_a_fused_layer_with_a_float_piece_dequantizes_the_quantized_ones():
    weight, values = quantized("Q8_0", 8, 2)
    layer = ColumnParallelLinear(64, {"gate": 8, "up": 8}, bias=False)
    layer.load_full("weight", weight, "gate")
    layer.load_full("weight", values, "up")
    assert layer.quantized is None
    assert torch.equal(layer.weight, torch.cat([values, values]))


def test_pieces_of_two_types_stay_quantized_each_in_its_type():
    # A K-quant mix keeps attn_v (or one of gate/up) in another type: nothing is dequantized.
    q8, q8_values = quantized("Q8_0", 8, 2)
    layer = ColumnParallelLinear(64, {"q": 8, "k": 8, "v": 8}, bias=False)
    q4_bytes = torch.randint(0, 0x3C, (8, 2 * BLOCK_LAYOUTS["Q4_1"].nbytes), dtype=torch.uint8)
    q4 = GGUF_FORMAT.load("Q4_1", q4_bytes, (8, 64))
    layer.load_full("weight", q8, "q")
    layer.load_full("weight", q8, "k")
    layer.load_full("weight", q4, "v")
    assert isinstance(layer.quantized, MixedPieces) and layer.weight is None
    assert [p.tensor_type for p in layer.quantized.parts] == ["Q8_0", "Q4_1"]  # q+k joined
    assert layer.quantized.nbytes == 2 * q8.nbytes + q4.nbytes
    values = torch.cat([q8_values, q8_values, q4.dequantize()])
    assert torch.equal(layer.quantized.dequantize(), values)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(layer(x), x @ values.t(), rtol=1e-5, atol=1e-5)
    # The pieces' outputs are joined by a C call: the product records for CPU step replay.
    replay, output = NativeCallCapturer().capture(lambda: layer(x))
    x.copy_(torch.randn(3, 64))
    replay()
    torch.testing.assert_close(output, x @ values.t(), rtol=1e-5, atol=1e-5)


def test_a_float_piece_among_quantized_ones_dequantizes_them():
    q8, q8_values = quantized("Q8_0", 8, 2)
    layer = ColumnParallelLinear(64, {"gate": 8, "up": 8}, bias=False)
    dense = torch.randn(8, 64)
    layer.load_full("weight", q8, "gate")
    layer.load_full("weight", dense, "up")
    assert layer.quantized is None
    assert torch.equal(layer.weight, torch.cat([q8_values, dense]))


@pytest.mark.parametrize("world_size", [2, 3])
def test_vocab_parallel_head_and_tied_embedding_use_their_rows_of_the_table(world_size):
    weight, values = quantized("Q8_0", 10, 2)  # 10 rows over 3 ranks: 4, 4, 2
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(3))
    embedding = VocabEmbedding(10, 64)
    embedding.load_full("weight", weight)
    ids = torch.tensor([9, 0, 4])
    assert torch.equal(embedding(ids), values[ids])
    untied, tied = [], []
    for group in ranks(world_size):
        head = VocabParallelLMHead(10, 64, has_weight=True, tp_group=group)
        head.load_full("weight", weight)
        assert head.quantized is not None
        untied.append(head(x))
        weightless = VocabParallelLMHead(10, 64, has_weight=False, tp_group=group)
        tied.append(weightless(x, embedding.table))
    for parts in (untied, tied):
        # Each rank's logits are its rows, the last rank's padded: drop the padding.
        close(torch.cat(parts, -1)[:, :10], x @ values.T)
