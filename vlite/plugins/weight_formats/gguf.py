"""The built-in weight format ``gguf``: GGUF block-quantized matrices and the C kernels.

A GGUF file stores a quantized matrix row by row, each row a run of blocks: ``values``
weights per block in ``nbytes`` bytes (:data:`vlite.kernels.native.BLOCK_LAYOUTS` gives both
for every type the kernels know: 32-value blocks for Q4_0/Q4_1/Q8_0, 256-value ones for the
K-quants, ...). :class:`GGUFBlockWeight` keeps those bytes, ``blocks`` ``[N, K / values *
nbytes]`` (or ``[E, N, ...]`` for stacked experts), and :class:`GGUFBlockFormat` computes
with them through the kernels of ``vlite/kernels/gguf_blocks.c``, which dequantize each
block in registers: products use exactly the file's dequantized values, and only the order
of the float32 sums differs from a dense product.

The kernels are CPU code built on first use; the format is unavailable on other devices
and on machines where they cannot be built (:meth:`GGUFBlockFormat.unavailable_reason`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from vlite.core.hookspecs import Register, hookimpl
from vlite.core.weight_format import (
    BlockAlignmentError,
    QuantizedWeight,
    WeightFormat,
    WeightFormatError,
    check_group_sizes,
)
from vlite.kernels.native import BLOCK_LAYOUTS, BlockLayout, gguf_block_kernels, unavailable_reason

NAME = "gguf"

#: Per value of the ``quantized_activations`` setting: type -> the integers its decode
#: products quantize the activations to (``GGUFBlockKernels.product``'s ``activations``;
#: absent: float32). 'auto' holds what passed the agreement oracle
#: (``benchmarks/agreement.py``) and measured faster than float32 (the README's table says
#: which and why).
_QUANTIZED_TYPES = frozenset(BLOCK_LAYOUTS) - {"F16", "BF16"}
ACTIVATIONS: dict[str, dict[str, str]] = {
    "off": {},
    "int8": dict.fromkeys(_QUANTIZED_TYPES, "int8"),
    "int16": dict.fromkeys(_QUANTIZED_TYPES, "int16"),
    # int16 agreed with float32 on 200/200 first tokens for every file of the README's type
    # matrix (int8: 187/200 on the default model). Against float32 on an AVX2 EPYC, one row:
    # 1.2x (Q8_0) to 1.9x (IQ4_XS); 8 rows: 0.86x (Q2_K), 1.0x (Q6_K), 1.1x-1.8x the rest
    # (benchmarks/quantized_activations.py).
    "auto": dict.fromkeys(_QUANTIZED_TYPES, "int16"),
}


def block_layout(qtype: str) -> BlockLayout:
    """The layout of GGUF type ``qtype``; a :class:`WeightFormatError` names the types the
    kernels take otherwise."""
    layout = BLOCK_LAYOUTS.get(qtype)
    if layout is None:
        raise WeightFormatError(
            f"weight format {NAME!r} has no kernel for GGUF type {qtype!r}; it takes "
            f"{', '.join(sorted(BLOCK_LAYOUTS))}"
        )
    return layout


class GGUFBlockWeight(QuantizedWeight):
    """A ``[N, K]`` matrix (``blocks`` ``[N, K / values * nbytes]``) or ``[E, N, K]`` stacked
    experts (``blocks`` ``[E, N, K / values * nbytes]``) as GGUF blocks of type ``qtype``.

    Row ``r`` of ``blocks`` is row ``r`` of the matrix, its ``K / values`` blocks in order.
    ``blocks`` is kept contiguous (cuts and joins copy where they must). ``weight_format``
    is the format that computes with it (default: the built-in one).

    Raises:
        WeightFormatError: an unknown type, or ``blocks`` that are not ``uint8`` rows of
            that many bytes (:class:`BlockAlignmentError`: ``cols`` is not a multiple of
            the type's values per block).
    """

    def __init__(
        self,
        qtype: str,
        blocks: torch.Tensor,
        cols: int,
        weight_format: GGUFBlockFormat | None = None,
    ) -> None:
        layout = block_layout(qtype)
        if cols % layout.values:
            raise BlockAlignmentError(
                f"a {qtype} row of {cols} columns is not a whole number of "
                f"{layout.values}-value blocks"
            )
        row_bytes = cols // layout.values * layout.nbytes
        shape_ok = blocks.dim() in (2, 3) and blocks.shape[-1] == row_bytes
        if blocks.dtype != torch.uint8 or not shape_ok:
            raise WeightFormatError(
                f"{qtype} blocks of rows of {cols} columns must be a uint8 tensor [N, "
                f"{row_bytes}] (or [E, N, {row_bytes}]), got {blocks.dtype} {list(blocks.shape)}"
            )
        self.qtype = qtype
        self.blocks = blocks.contiguous()
        self.cols = cols
        #: The format that made it (a subclass of the built-in one keeps its own methods).
        self._format = GGUF_FORMAT if weight_format is None else weight_format
        #: The kernels' product functions, one per matrix (per expert), made on first use.
        self._products: list[Callable[[torch.Tensor], torch.Tensor]] | None = None

    @property
    def format(self) -> GGUFBlockFormat:
        return self._format

    @property
    def tensor_type(self) -> str:
        return self.qtype

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.blocks.shape[:-1], self.cols)

    @property
    def nbytes(self) -> int:
        return self.blocks.numel() * self.blocks.element_size()

    def products(self) -> list[Callable[[torch.Tensor], torch.Tensor]]:
        """``x -> x @ W^T`` for the matrix (one per expert of a stack), checked once."""
        if self._products is None:
            kernels = gguf_block_kernels()
            matrices = [self.blocks] if self.blocks.dim() == 2 else list(self.blocks)
            activations = self._format.activations.get(self.qtype, "float32")
            self._products = [
                kernels.product(self.qtype, blocks, blocks.shape[0], self.cols, activations)
                for blocks in matrices
            ]
        return self._products


class GGUFBlockFormat(WeightFormat):
    """GGUF's block-quantized types, computed by vlite's C kernels on the CPU."""

    tensor_types = frozenset(BLOCK_LAYOUTS)

    def configure(self, config: Any) -> None:
        """Take ``config.quantized_activations`` (see :data:`ACTIVATIONS`)."""
        self.activations = ACTIVATIONS[config.quantized_activations]

    #: Type -> ``"int8"`` or ``"int16"``: the integers its products of few rows (decode
    #: steps and short prefills: fewer than ``GGUFBlockKernels.quantized_rows``; at int16
    #: every product where ``GGUFBlockKernels.int16_gemm_rows``) quantize
    #: the activations to, with integer dot products; absent:
    #: float32 activations, the exact path. Set from the engine's ``quantized_activations``
    #: by :meth:`configure`.
    activations: dict[str, str] = {}  # replaced by configure, never mutated

    description = "weight-only CPU kernels"

    def activations_line(self, tensor_types: Iterable[str]) -> str:
        """How decode steps take the activations for ``tensor_types`` (the kept ones), for
        the plan's line: ``"int16 activations for Q4_K, Q6_K"``, or ``""`` when every one
        keeps float32."""
        groups: dict[str, list[str]] = {}
        kernels = gguf_block_kernels()
        for tensor_type in sorted(tensor_types):
            activations = self.activations.get(tensor_type)
            if activations and kernels.has_quantized_activations(tensor_type):
                groups.setdefault(activations, []).append(tensor_type)
        return "; ".join(
            f"{activations} activations for {', '.join(types)}"
            for activations, types in sorted(groups.items())
        )

    def unavailable_reason(self, device: torch.device) -> str | None:
        device_type = torch.device(device).type
        if device_type != "cpu":
            return f"the GGUF kernels run on the CPU, not {device_type}"
        return unavailable_reason()

    def block_values(self, tensor_type: str) -> int:
        return block_layout(tensor_type).values

    def load(self, tensor_type: str, data: torch.Tensor, shape: tuple[int, int]) -> GGUFBlockWeight:
        rows, cols = shape
        if data.dim() != 2 or data.shape[0] != rows:
            raise WeightFormatError(
                f"a {tensor_type} matrix {list(shape)} needs its bytes as {rows} rows "
                f"[{rows}, row_bytes], got {list(data.shape)}"
            )
        return GGUFBlockWeight(tensor_type, data, cols, self)

    def narrow(self, weight: QuantizedWeight, dim: int, start: int, length: int) -> GGUFBlockWeight:
        weight = _own(weight)
        ndim = weight.ndim
        axis = dim + ndim if dim < 0 else dim
        if not 0 <= axis < ndim:
            raise WeightFormatError(f"dimension {dim} is outside a {ndim}-dimensional weight")
        size = weight.shape[axis]
        if start < 0 or length < 0 or start + length > size:
            raise WeightFormatError(
                f"indices {start}:{start + length} are outside dimension {dim} of size {size} "
                f"of a {weight.qtype} weight {list(weight.shape)}"
            )
        if axis < ndim - 1:  # experts or rows: whole rows of blocks
            blocks = weight.blocks.narrow(axis, start, length)
            return GGUFBlockWeight(weight.qtype, blocks, weight.cols, self)
        layout = block_layout(weight.qtype)
        if start % layout.values or length % layout.values:
            raise BlockAlignmentError(
                f"columns {start}:{start + length} do not fall on {layout.values}-value "
                f"{weight.qtype} blocks"
            )
        first, count = start // layout.values, length // layout.values
        blocks = weight.blocks.narrow(-1, first * layout.nbytes, count * layout.nbytes)
        return GGUFBlockWeight(weight.qtype, blocks.contiguous(), length, self)

    def cat_rows(self, weights: Sequence[QuantizedWeight]) -> GGUFBlockWeight:
        owned = _same_kind(weights, "cat_rows")
        if owned[0].ndim != 2:
            raise WeightFormatError(
                f"cat_rows joins [N, K] matrices, got {[list(w.shape) for w in owned]}"
            )
        if len(owned) == 1 and _owns_its_storage(owned[0].blocks):
            return owned[0]  # one whole weight (a view of a mapped file, say): no copy
        blocks = torch.cat([w.blocks for w in owned])
        return GGUFBlockWeight(owned[0].qtype, blocks, owned[0].cols, self)

    def stack(self, weights: Sequence[QuantizedWeight]) -> GGUFBlockWeight:
        owned = _same_kind(weights, "stack")
        shapes = {w.shape for w in owned}
        if len(shapes) != 1 or owned[0].ndim != 2:
            raise WeightFormatError(
                f"stack needs [N, K] matrices of one shape, got {sorted(map(list, shapes))}"
            )
        blocks = torch.stack([w.blocks for w in owned])
        return GGUFBlockWeight(owned[0].qtype, blocks, owned[0].cols, self)

    def dequantize(self, weight: QuantizedWeight) -> torch.Tensor:
        weight = _own(weight)
        blocks = weight.blocks.reshape(-1, weight.blocks.shape[-1])
        values = gguf_block_kernels().dequantize(weight.qtype, blocks, weight.cols)
        return values.view(weight.shape)

    def linear(self, weight: QuantizedWeight, x: torch.Tensor) -> torch.Tensor:
        weight = _own(weight)
        if weight.blocks.dim() != 2:
            raise ValueError(f"linear needs an [N, K] matrix, got {list(weight.shape)}")
        if x.shape[0] == 0:  # no rows: nothing for the kernel to do
            if x.dim() != 2 or x.shape[1] != weight.cols:
                raise ValueError(f"expected an [M, {weight.cols}] input, got {list(x.shape)}")
            return x.new_empty(0, weight.blocks.shape[0])
        return weight.products()[0](x)

    def embedding(self, weight: QuantizedWeight, row_ids: torch.Tensor) -> torch.Tensor:
        weight = _own(weight)
        if weight.ndim != 2:
            raise ValueError(f"embedding needs an [N, K] matrix, got {list(weight.shape)}")
        return gguf_block_kernels().gather_rows(weight.qtype, weight.blocks, weight.cols, row_ids)

    def expert_linear(
        self, weight: QuantizedWeight, x: torch.Tensor, group_sizes: Sequence[int]
    ) -> torch.Tensor:
        weight = _own(weight)
        check_group_sizes(weight, x, group_sizes)
        out = x.new_empty(x.shape[0], weight.shape[1])
        start = 0
        for product, size in zip(weight.products(), group_sizes):
            if size:
                out[start : start + size] = product(x[start : start + size])
                start += size
        return out


#: The instance :attr:`GGUFBlockWeight.format` returns by default (float32 activations).
GGUF_FORMAT = GGUFBlockFormat()


def _own(weight: QuantizedWeight) -> GGUFBlockWeight:
    if not isinstance(weight, GGUFBlockWeight):
        raise TypeError(f"weight format {NAME!r} was handed {weight!r}, not a GGUFBlockWeight")
    return weight


def _same_kind(weights: Sequence[QuantizedWeight], operation: str) -> list[GGUFBlockWeight]:
    """``weights`` as this format's, all of one type and width (else a typed error)."""
    owned = [_own(w) for w in weights]
    if not owned:
        raise WeightFormatError(f"{operation} needs at least one weight")
    kinds = {(w.qtype, w.cols) for w in owned}
    if len(kinds) != 1:
        described = ", ".join(f"{qtype} with {cols} columns" for qtype, cols in sorted(kinds))
        raise WeightFormatError(f"{operation} needs weights of one type and width, got {described}")
    return owned


@hookimpl
def register_weight_formats(register: Register) -> None:
    register(NAME, GGUFBlockFormat)


def _owns_its_storage(blocks: torch.Tensor) -> bool:
    """Whether ``blocks`` is the whole of its storage (so keeping it keeps nothing more
    alive: not a row slice of a larger tensor)."""
    whole = blocks.numel() * blocks.element_size()
    return blocks.is_contiguous() and blocks.untyped_storage().nbytes() == whole
