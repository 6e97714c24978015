"""A fused layer's weight whose pieces arrived quantized in different types.

K-quant mixes quantize a layer's pieces differently (llama.cpp's Q4_K_M keeps ``attn_v`` in
Q6_K or Q8_0 beside Q4_K/Q5_0 ``attn_q``/``attn_k``), so a fused q/k/v or gate/up
projection may hold pieces of several types. :class:`MixedPieces` keeps each run of pieces
that one format can join as one quantized weight and multiplies by each in turn, writing
its output features in piece order: nothing is dequantized.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from vlite.core.weight_format import QuantizedWeight, joinable
from vlite.kernels import native


class MixedPieces:
    """Row runs ``parts`` of a ``[N, K]`` weight, each a :class:`QuantizedWeight`.

    Offers what a layer uses of a quantized weight: :attr:`shape`, :attr:`nbytes`,
    :meth:`matmul` and :meth:`dequantize`.
    """

    def __init__(self, parts: Sequence[QuantizedWeight]) -> None:
        self.parts = list(parts)
        self.shape = (sum(p.shape[0] for p in self.parts), self.parts[0].shape[1])

    @classmethod
    def join(cls, pieces: Sequence[QuantizedWeight]) -> QuantizedWeight | MixedPieces:
        """``pieces`` (row runs in order) joined: one weight where one format can join them
        all, else a :class:`MixedPieces` of the longest joinable runs."""
        runs: list[list[QuantizedWeight]] = []
        for piece in pieces:
            if runs and joinable([runs[-1][0], piece]):
                runs[-1].append(piece)
            else:
                runs.append([piece])
        joined = [run[0].format.cat_rows(run) for run in runs]
        return joined[0] if len(joined) == 1 else cls(joined)

    @property
    def nbytes(self) -> int:
        return sum(part.nbytes for part in self.parts)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[..., K]`` -> ``[..., N]``: each part's product, in row order.

        On float32 CPU rows each product is copied into its columns by a C call, so a
        forward of C calls (CPU step replay) stays one; elsewhere ``torch.cat``.
        """
        products = [part.matmul(x) for part in self.parts]
        ops = _copy_ops()
        on_cpu = x.device.type == "cpu" and products[0].dtype == torch.float32
        if ops is None or x.dim() != 2 or not on_cpu:
            return torch.cat(products, dim=-1)
        out = torch.empty(x.shape[0], self.shape[0], dtype=torch.float32)
        start = 0
        for product in products:
            width = product.shape[-1]
            ops.copy_columns_(out[:, start : start + width], product.contiguous())
            start += width
        return out

    def dequantize(self) -> torch.Tensor:
        """The whole ``[N, K]`` weight as float32."""
        return torch.cat([part.dequantize() for part in self.parts])


def _copy_ops() -> native.FusedOps | None:
    """The C kernels' column copy, or ``None`` where they cannot be built."""
    try:
        return native.fused_ops()
    except native.NativeKernelsUnavailable:
        return None
