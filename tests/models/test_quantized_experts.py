"""FusedMoE with quantized experts: kept stacked in their weight format, run through its
grouped product, equal to the float experts holding the same (dequantized) values, on one
rank and spread over ranks; anything short of all-quantized-and-joinable is dequantized."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from vlite.distributed.parallel_state import TensorParallelGroup
from vlite.kernels.native import BLOCK_LAYOUTS
from vlite.models.fused_moe import FusedMoE, QuantizedExperts
from vlite.plugins.weight_formats.gguf import GGUF_FORMAT

HIDDEN, INNER, EXPERTS, TOP_K = 64, 32, 6, 2


@dataclasses.dataclass(frozen=True)
class LocalShare(TensorParallelGroup):
    """A rank's view without the collective: its share of the output, not the sum."""

    def all_reduce(self, tensor):
        return tensor


def random_matrix(qtype: str, rows: int, cols: int, generator: torch.Generator):
    layout = BLOCK_LAYOUTS[qtype]
    shape = (rows, cols // layout.values * layout.nbytes)
    data = torch.randint(0, 0x3C, shape, generator=generator, dtype=torch.uint8)
    return GGUF_FORMAT.load(qtype, data, (rows, cols))


def experts_checkpoint(types=("Q8_0", "Q8_0", "Q4_1"), seed: int = 0):
    """Per expert ``{piece: quantized matrix}`` (gate, up of ``types[0:2]``, down of
    ``types[2]``)."""
    generator = torch.Generator().manual_seed(seed)
    shapes = {"gate": (INNER, HIDDEN), "up": (INNER, HIDDEN), "down": (HIDDEN, INNER)}
    return [
        {
            piece: random_matrix(qtype, *shapes[piece], generator)
            for piece, qtype in zip(("gate", "up", "down"), types)
        }  # fmt: skip
        for _ in range(EXPERTS)
    ]


def load(moe: FusedMoE, checkpoint, dequantize: bool = False) -> FusedMoE:
    for expert, pieces in enumerate(checkpoint):
        for piece, weight in pieces.items():
            moe.load_expert(expert, piece, weight.dequantize() if dequantize else weight)
    return moe


def inputs(num_tokens: int = 9):
    generator = torch.Generator().manual_seed(1)
    hidden = torch.randn(num_tokens, HIDDEN, generator=generator)
    return hidden, torch.randn(num_tokens, EXPERTS, generator=generator)


def close(actual, expected):
    scale = expected.abs().max().item() + 1.0
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5 * scale)


def test_quantized_experts_equal_float_experts_of_the_same_values():
    checkpoint = experts_checkpoint()
    quantized = load(FusedMoE(EXPERTS, TOP_K, HIDDEN, INNER, True, impl="torch"), checkpoint)
    dense = load(FusedMoE(EXPERTS, TOP_K, HIDDEN, INNER, True, impl="torch"), checkpoint, True)
    assert isinstance(quantized.quantized, QuantizedExperts) and quantized.w13 is None
    assert quantized.quantized.w13.shape == (EXPERTS, 2 * INNER, HIDDEN)
    assert quantized.quantized.w2.tensor_type == "Q4_1"
    assert quantized.quantized.nbytes == (
        quantized.quantized.w13.blocks.numel() + quantized.quantized.w2.blocks.numel()
    )
    assert torch.equal(quantized.quantized.w13.dequantize(), dense.w13)
    assert dense.quantized is None
    hidden, logits = inputs()
    close(quantized(hidden, logits), dense(hidden, logits))
    empty = quantized(hidden[:0], logits[:0])
    assert tuple(empty.shape) == (0, HIDDEN)


def test_quantized_experts_keep_the_hidden_dtype():
    moe = load(FusedMoE(EXPERTS, TOP_K, HIDDEN, INNER, True), experts_checkpoint())
    hidden, logits = inputs()
    out = moe(hidden.bfloat16(), logits)
    assert out.dtype == torch.bfloat16
    expected = moe(hidden.bfloat16().float(), logits)  # the same inputs, summed in float32
    scale = expected.abs().max().item()
    torch.testing.assert_close(out.float(), expected, rtol=2e-2, atol=2e-2 * scale)


@pytest.mark.parametrize("world_size", [2, 3])
def test_ranks_keep_their_whole_experts_and_their_shares_add_up(world_size):
    checkpoint = experts_checkpoint()
    hidden, logits = inputs()
    whole = load(FusedMoE(EXPERTS, TOP_K, HIDDEN, INNER, True), checkpoint)
    total = torch.zeros_like(hidden)
    for rank in range(world_size):
        group = LocalShare(rank, world_size, process_group="not used")
        moe = load(FusedMoE(EXPERTS, TOP_K, HIDDEN, INNER, True, group), checkpoint)
        assert moe.quantized.w13.shape[0] == EXPERTS // world_size
        total += moe(hidden, logits)
    close(total, whole(hidden, logits))


def test_gate_and_up_of_different_types_are_dequantized():
    checkpoint = experts_checkpoint(types=("Q8_0", "Q4_1", "Q8_0"))
    moe = load(FusedMoE(EXPERTS, TOP_K, HIDDEN, INNER, True), checkpoint)
    dense = load(FusedMoE(EXPERTS, TOP_K, HIDDEN, INNER, True), checkpoint, True)
    assert moe.quantized is None and torch.equal(moe.w13, dense.w13)
    hidden, logits = inputs()
    assert torch.equal(moe(hidden, logits), dense(hidden, logits))


def test_one_float_matrix_makes_the_layer_dequantize_the_rest():
    checkpoint = experts_checkpoint()
    checkpoint[4]["down"] = checkpoint[4]["down"].dequantize()
    moe = load(FusedMoE(EXPERTS, TOP_K, HIDDEN, INNER, True), checkpoint)
    assert moe.quantized is None
    assert torch.equal(moe.w2[4], checkpoint[4]["down"])
    assert torch.equal(moe.w2[0], checkpoint[0]["down"].dequantize())
    assert moe.missing_weights() == []
