"""A layer's experts through the grouped GEMM: align, two launches, a per-token sum.

1. :func:`~vlite.models.moe_kernels.align.align_pairs_to_blocks` groups the step's ``P =
   T * top_k`` (token, expert) pairs by expert into ``block_m``-row blocks;
2. the gated launch multiplies each pair's token row by its expert's ``w13`` and stores
   ``SiLU(gate) * up``: ``[P, intermediate]``;
3. the weighted launch multiplies those rows by the expert's ``w2`` and the pair's routed
   weight: ``[P, hidden]``, zeros for pairs routed to other ranks' experts;
4. each token sums its ``top_k`` rows (pair ``p`` is token ``p // top_k``'s).

No host-device synchronisation: every size comes from shapes.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from vlite.models.moe_kernels.align import align_pairs_to_blocks
from vlite.models.moe_kernels.config import MoETiles, choose_tiles


def grouped_experts(
    grouped_gemm: Callable[..., torch.Tensor],
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    routed_weights: torch.Tensor,
    routed_experts: torch.Tensor,
    first_expert: int,
    num_experts: int,
    *,
    interpreted: bool,
    tiles: MoETiles | None = None,
) -> torch.Tensor:
    """This rank's share of the layer's output.

    Args:
        grouped_gemm: the launcher,
            :func:`~vlite.models.moe_kernels.grouped_gemm.grouped_gemm` of the loaded mode.
        hidden: ``[T, hidden]``.
        w13: ``[num_local_experts, 2 * intermediate, hidden]``, gate rows then up rows.
        w2: ``[num_local_experts, hidden, intermediate]``.
        routed_weights: ``[T, top_k]`` float32.
        routed_experts: ``[T, top_k]`` int64, experts in all ranks' numbering.
        first_expert: the global index of this rank's first expert.
        num_experts: experts of the layer, all ranks together.
        interpreted: whether the kernels run under the interpreter (for the tile sizes).
        tiles: force the tile sizes (default: :func:`~.config.choose_tiles`).

    Returns:
        ``[T, hidden]`` in ``hidden``'s dtype: the local experts' weighted outputs summed
        per token.
    """
    num_tokens, hidden_size = hidden.shape
    top_k = routed_experts.shape[1]
    num_local_experts, _, intermediate = w2.shape
    num_pairs = num_tokens * top_k
    if tiles is None:
        widest = max(hidden_size, 2 * intermediate)
        tiles = choose_tiles(
            num_pairs, num_local_experts, widest, hidden.element_size(), interpreted
        )
    blocks = align_pairs_to_blocks(routed_experts.flatten(), num_experts, tiles.block_m)
    activations = grouped_gemm(
        hidden,
        w13,
        hidden.new_empty(num_pairs, intermediate),
        blocks,
        tiles,
        first_expert=first_expert,
        pairs_per_a_row=top_k,
        gated=True,
    )
    pair_outputs = grouped_gemm(
        activations,
        w2,
        hidden.new_empty(num_pairs, hidden_size),
        blocks,
        tiles,
        first_expert=first_expert,
        pairs_per_a_row=1,
        routed_weights=routed_weights.flatten().float(),
        zero_unrouted=True,
    )
    return pair_outputs.view(num_tokens, top_k, hidden_size).sum(dim=1)
