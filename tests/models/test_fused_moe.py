"""FusedMoE: routing, tokens grouped by expert, whole experts per rank."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from vlite.distributed.parallel_state import TensorParallelGroup
from vlite.models.fused_moe import FusedMoE, route

HIDDEN, INNER, EXPERTS, TOP_K = 16, 8, 6, 2


@dataclasses.dataclass(frozen=True)
class LocalShare(TensorParallelGroup):
    """A rank's view without the collective: its share of the output, not the sum."""

    def all_reduce(self, tensor):
        return tensor


def loaded_moe(group=None, seed: int = 0, renormalize: bool = True) -> FusedMoE:
    moe = FusedMoE(EXPERTS, TOP_K, HIDDEN, INNER, renormalize, group or LocalShare())
    generator = torch.Generator().manual_seed(seed)
    for expert in range(EXPERTS):
        for piece in ("gate", "up", "down"):
            shape = moe.expected_shape(piece)
            moe.load_expert(expert, piece, torch.randn(*shape, generator=generator))
    return moe


def reference(moe: FusedMoE, weights_by_expert, hidden, logits) -> torch.Tensor:
    """One token at a time, one expert at a time, from the checkpoint matrices."""
    weights, experts = route(logits, TOP_K, moe.renormalize)
    out = torch.zeros_like(hidden)
    for token in range(hidden.shape[0]):
        for slot in range(TOP_K):
            gate, up, down = weights_by_expert[int(experts[token, slot])]
            x = hidden[token]
            y = F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)
            out[token] += y * weights[token, slot]
    return out


def checkpoint(seed: int = 0) -> list[tuple[torch.Tensor, ...]]:
    generator = torch.Generator().manual_seed(seed)
    moe = FusedMoE(EXPERTS, TOP_K, HIDDEN, INNER, True)
    pieces = ("gate", "up", "down")
    return [
        tuple(torch.randn(*moe.expected_shape(p), generator=generator) for p in pieces)
        for _ in range(EXPERTS)
    ]


def test_routing_takes_the_top_k_probabilities_and_renormalizes_them():
    logits = torch.tensor([[0.0, 2.0, 1.0, -1.0]])
    weights, experts = route(logits, 2, renormalize=True)
    assert experts.tolist() == [[1, 2]]
    probabilities = F.softmax(logits, -1)[0]
    expected = probabilities[[1, 2]] / probabilities[[1, 2]].sum()
    torch.testing.assert_close(weights[0], expected)
    raw, _ = route(logits, 2, renormalize=False)
    torch.testing.assert_close(raw[0], probabilities[[1, 2]])


@pytest.mark.parametrize("renormalize", [True, False])
def test_grouped_experts_equal_a_token_by_token_reference(renormalize):
    moe = loaded_moe(renormalize=renormalize)
    weights_by_expert = checkpoint()
    generator = torch.Generator().manual_seed(3)
    hidden = torch.randn(11, HIDDEN, generator=generator)
    logits = torch.randn(11, EXPERTS, generator=generator)
    torch.testing.assert_close(
        moe(hidden, logits), reference(moe, weights_by_expert, hidden, logits)
    )


def test_each_rank_holds_whole_experts_and_the_shares_sum_to_the_output():
    full = loaded_moe()
    shares = [
        loaded_moe(LocalShare(rank=rank, world_size=3, process_group=object())) for rank in range(3)
    ]
    assert [(s.first_expert, s.end_expert) for s in shares] == [(0, 2), (2, 4), (4, 6)]
    assert all(share.w13.shape[0] == 2 for share in shares)
    generator = torch.Generator().manual_seed(5)
    hidden = torch.randn(9, HIDDEN, generator=generator)
    logits = torch.randn(9, EXPERTS, generator=generator)
    total = sum(share(hidden, logits) for share in shares)
    torch.testing.assert_close(total, full(hidden, logits))


def test_experts_must_split_evenly_and_every_matrix_must_arrive():
    with pytest.raises(ValueError, match="6 experts do not split over tensor_parallel_size=4"):
        FusedMoE(
            EXPERTS,
            TOP_K,
            HIDDEN,
            INNER,
            True,
            LocalShare(rank=0, world_size=4, process_group=object()),
        )
    moe = FusedMoE(EXPERTS, TOP_K, HIDDEN, INNER, True)
    moe.load_expert(0, "gate", torch.zeros(INNER, HIDDEN))
    assert "expert 0 up" in moe.missing_weights() and "expert 0 gate" not in moe.missing_weights()
    with pytest.raises(ValueError, match=r"expert 1 down matrix has shape \(8, 16\)"):
        moe.load_expert(1, "down", torch.zeros(INNER, HIDDEN))
