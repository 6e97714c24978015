"""GGUF weights kept block-quantized: the tensor type loaders hand to layers, and the plan.

A GGUF file stores most matrices as blocks of 32 values (see :mod:`vlite.kernels.native`).
With ``quantization="auto"`` (the default) the GGUF loader yields the Q4_0, Q4_1 and Q8_0
matrices as :class:`BlockQuantizedTensor` — the file's bytes, row by row — and the linear
layers and the embedding keep them that way, multiplying with the C kernels that
dequantize each block in registers. The values they compute with are exactly the file's
dequantized values; only the order of the float32 sums differs from a dense product.

Other quantized types (K-quants, ...) have no kernel here: they are dequantized to the
model dtype, and :class:`QuantizationPlan` names them. ``quantization="none"`` dequantizes
everything, as does a CUDA device (the kernels are CPU code) or a machine where the
kernels cannot be built (the plan says why). ``quantization="gguf"`` is ``auto`` that
refuses to fall back: a model that is not a GGUF file, has no Q4_0/Q4_1/Q8_0 tensor, or a
device or machine where the kernels cannot run is an error saying which.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch

from vlite.kernels.native import BLOCK_LAYOUTS, gguf_block_kernels, unavailable_reason

#: Values of the ``quantization`` setting: ``auto`` keeps what it can, ``gguf`` insists
#: (an error where nothing can be kept), ``none`` dequantizes everything.
QUANTIZATION_CHOICES = ("auto", "gguf", "none")
#: GGUF tensor types the kernels multiply by without dequantizing.
KERNEL_TYPES = frozenset(BLOCK_LAYOUTS)
#: Types that hold plain floats: never "quantized".
_FLOAT_TYPES = frozenset({"F32", "F16", "BF16", "F64"})


@dataclass(frozen=True, eq=False)
class BlockQuantizedTensor:
    """A ``[rows, cols]`` matrix as GGUF blocks: ``blocks`` ``[rows, cols / 32 * block_bytes]``.

    Row ``r`` of ``blocks`` is row ``r`` of the matrix, ``cols / 32`` blocks in order.
    """

    qtype: str
    blocks: torch.Tensor
    cols: int

    def __post_init__(self) -> None:
        if self.qtype not in BLOCK_LAYOUTS:
            raise ValueError(f"no kernel for GGUF type {self.qtype} (have {sorted(BLOCK_LAYOUTS)})")
        values = BLOCK_LAYOUTS[self.qtype].values
        if self.cols % values:
            raise ValueError(f"{self.cols} columns is not a multiple of {values} ({self.qtype})")

    @property
    def shape(self) -> tuple[int, int]:
        return (self.blocks.shape[0], self.cols)

    def narrow(self, dim: int, start: int, length: int) -> BlockQuantizedTensor:
        """Rows (``dim=0``) or whole blocks of columns (``dim=1``) ``start:start+length``."""
        if dim == 0:
            return BlockQuantizedTensor(self.qtype, self.blocks.narrow(0, start, length), self.cols)
        layout = BLOCK_LAYOUTS[self.qtype]
        if start % layout.values or length % layout.values:
            raise ValueError(
                f"columns {start}:{start + length} do not fall on {layout.values}-value "
                f"{self.qtype} blocks"
            )
        blocks = self.blocks.narrow(
            1, start // layout.values * layout.nbytes, length // layout.values * layout.nbytes
        )
        return BlockQuantizedTensor(self.qtype, blocks, length)

    def dequantize(self) -> torch.Tensor:
        """The matrix as a new float32 tensor (exactly the file's values)."""
        return gguf_block_kernels().dequantize(self.qtype, self.blocks.contiguous(), self.cols)


def concat_rows(pieces: list[BlockQuantizedTensor]) -> BlockQuantizedTensor | None:
    """The pieces stacked row-wise, or ``None`` if they differ in type or columns."""
    first = pieces[0]
    if any(p.qtype != first.qtype or p.cols != first.cols for p in pieces):
        return None
    return BlockQuantizedTensor(
        first.qtype, torch.cat([p.blocks for p in pieces]).contiguous(), first.cols
    )


class QuantizedMatrix:
    """A layer's weight ``W`` ``[out_features, in_features]`` kept as GGUF blocks.

    :meth:`matmul` computes ``x @ W^T`` in float32 whatever ``x``'s dtype and returns that
    dtype.
    """

    def __init__(self, tensor: BlockQuantizedTensor) -> None:
        self.qtype = tensor.qtype
        self.blocks = tensor.blocks.contiguous()
        self.out_features, self.in_features = tensor.shape
        self._kernels = gguf_block_kernels()
        self._product = self._kernels.product(
            self.qtype, self.blocks, self.out_features, self.in_features
        )

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[..., in_features]`` -> ``[..., out_features]`` in ``x.dtype``."""
        if x.dim() != 2:
            out = self.matmul(x.reshape(-1, self.in_features))
            return out.view(*x.shape[:-1], self.out_features)
        if x.dtype != torch.float32:
            return self.matmul(x.float()).to(x.dtype)
        return self._product(x)

    def rows(self, row_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows ``row_ids`` ``[T]`` as ``[T, in_features]`` (an embedding lookup)."""
        rows = self._kernels.gather_rows(self.qtype, self.blocks, self.in_features, row_ids.long())
        return rows.to(dtype)

    def narrow_rows(self, start: int, length: int) -> QuantizedMatrix:
        return QuantizedMatrix(
            BlockQuantizedTensor(self.qtype, self.blocks[start : start + length], self.in_features)
        )


@dataclass(frozen=True)
class QuantizationPlan:
    """What ``quantization`` means for one model on one device.

    Attributes:
        setting: the ``quantization`` setting (``"auto"``, ``"gguf"`` or ``"none"``).
        kept: GGUF tensor type -> how many tensors stay block-quantized.
        dequantized: quantized GGUF type -> how many tensors are dequantized to the dtype.
        reason: why no tensor is kept, when none is.
    """

    setting: str
    kept: dict[str, int] = field(default_factory=dict)
    dequantized: dict[str, int] = field(default_factory=dict)
    reason: str | None = None

    @property
    def keep_types(self) -> frozenset[str]:
        return frozenset(self.kept)

    def describe(self, dtype: torch.dtype) -> str:
        """One line for ``vlite run``/``serve``, e.g. ``GGUF Q4_1 x210, Q8_0 x1 (kept)``."""
        dtype_name = str(dtype).removeprefix("torch.")
        if not self.kept:
            why = f" ({self.reason})" if self.reason else ""
            return f"none: weights in {dtype_name}{why}"
        kept = ", ".join(f"{name} x{count}" for name, count in sorted(self.kept.items()))
        line = f"GGUF {kept} kept quantized (weight-only CPU kernels)"
        if self.dequantized:
            other = ", ".join(f"{n} x{c}" for n, c in sorted(self.dequantized.items()))
            line += f"; {other} dequantized to {dtype_name} (no kernel for these types)"
        return line


def plan_quantization(setting: str, gguf_tensor_types: list[str] | None, device: Any):
    """The :class:`QuantizationPlan` for a model whose tensors have ``gguf_tensor_types``.

    Args:
        setting: ``"auto"``, ``"gguf"`` or ``"none"``.
        gguf_tensor_types: the GGUF type name of every tensor, or ``None`` for a model
            that is not a GGUF file.
        device: the engine's ``torch.device``.

    Raises:
        ValueError: an unknown ``setting`` (the message lists the allowed values), or
            ``"gguf"`` where no weight can stay quantized (the message says why).
    """
    if setting not in QUANTIZATION_CHOICES:
        raise ValueError(
            f"quantization={setting!r} is not supported; choose one of {QUANTIZATION_CHOICES}"
        )
    plan = _plan(setting, gguf_tensor_types, device)
    if setting == "gguf" and not plan.kept:
        raise ValueError(
            f"quantization='gguf' keeps a GGUF file's Q4_0/Q4_1/Q8_0 weights, but here none "
            f"can be kept: {plan.reason}; use quantization='auto' (keep what can be kept) or "
            "'none'"
        )
    return plan


def _plan(setting: str, gguf_tensor_types: list[str] | None, device: Any) -> QuantizationPlan:
    if gguf_tensor_types is None:
        return QuantizationPlan(setting, reason="not a GGUF file")
    quantized = Counter(t for t in gguf_tensor_types if t not in _FLOAT_TYPES)
    if not quantized:
        return QuantizationPlan(setting, reason="the GGUF file holds no quantized tensor")
    why_not = None
    if setting == "none":
        why_not = "quantization='none'"
    elif torch.device(device).type != "cpu":
        why_not = f"the GGUF kernels run on the CPU, not {torch.device(device).type}"
    else:
        why_not = unavailable_reason()
    if why_not is not None:
        return QuantizationPlan(setting, dequantized=dict(quantized), reason=why_not)
    kept = {name: n for name, n in quantized.items() if name in KERNEL_TYPES}
    other = {name: n for name, n in quantized.items() if name not in KERNEL_TYPES}
    reason = None if kept else f"no tensor of a type with a kernel ({', '.join(sorted(other))})"
    return QuantizationPlan(setting, kept=kept, dequantized=other, reason=reason)
