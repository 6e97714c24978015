"""GGUF weights kept quantized: the plan, and the names layers and tests know them by.

A GGUF file stores most matrices as rows of blocks (see :mod:`vlite.kernels.native`). With
``quantization="auto"`` (the default) the GGUF loader hands every tensor whose type a
registered weight format takes (:mod:`vlite.core.weight_format`; the built-in ``gguf``
format, :mod:`vlite.plugins.weight_formats.gguf`, takes every type the C kernels know) to
the model as that format's :class:`~vlite.core.weight_format.QuantizedWeight`, and the
linear layers, the embedding and the experts keep it that way, computing through the
format. The built-in format's kernels dequantize each block in registers: the values they
compute with are exactly the file's dequantized values; only the order of the float32 sums
differs from a dense product.

16-bit float matrices (F16, BF16) are kept the same way when a format takes their type (the
built-in one does: half the memory of float32). Types no available format takes are
dequantized to the model dtype, and
:class:`QuantizationPlan` names them. ``quantization="none"`` dequantizes everything, as
does a device or machine where no format taking the file's types can run (the plan says
why: the built-in kernels are CPU code that must compile here). ``quantization="gguf"`` is
``auto`` that refuses to fall back: a model that is not a GGUF file, has no tensor a format
takes, or a device where none can run is an error saying which.

:class:`BlockQuantizedTensor` (the built-in format's weight), :class:`QuantizedMatrix` and
:func:`concat_rows` are the names this module gave GGUF weights before weight formats were
plugins; they keep working.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from vlite.core.config import setting_choices
from vlite.core.errors import ConfigError
from vlite.core.weight_format import QuantizedWeight, WeightFormat, joinable
from vlite.kernels.native import BLOCK_LAYOUTS
from vlite.plugins.weight_formats.gguf import NAME as GGUF_FORMAT_NAME
from vlite.plugins.weight_formats.gguf import GGUFBlockFormat, GGUFBlockWeight

#: Values of the ``quantization`` setting: ``auto`` keeps what it can, ``gguf`` insists
#: (an error where nothing can be kept), ``none`` dequantizes everything.
QUANTIZATION_CHOICES = setting_choices("quantization")
#: GGUF tensor types the built-in ``gguf`` format's kernels multiply by without dequantizing.
KERNEL_TYPES = frozenset(BLOCK_LAYOUTS)
#: Types that hold plain floats: not "quantized" (the plan never lists them as dequantized).
_FLOAT_TYPES = frozenset({"F32", "F16", "BF16", "F64"})
#: Float types no format keeps: the model's dtype holds them as well.
_NEVER_KEPT = frozenset({"F32", "F64"})

#: A GGUF matrix as the built-in format keeps it: ``BlockQuantizedTensor(qtype, blocks,
#: cols)``, ``blocks`` ``[rows, cols / values * block_bytes]`` (the earlier name of
#: :class:`~vlite.plugins.weight_formats.gguf.GGUFBlockWeight`).
BlockQuantizedTensor = GGUFBlockWeight


def concat_rows(pieces: list[QuantizedWeight]) -> QuantizedWeight | None:
    """The pieces stacked row-wise by their format, or ``None`` if they differ in format,
    type or columns."""
    if not joinable(pieces):
        return None
    return pieces[0].format.cat_rows(pieces)


class _QuantizedMatrixType(type):
    def __instancecheck__(cls, instance: object) -> bool:
        return isinstance(instance, QuantizedWeight)


class QuantizedMatrix(metaclass=_QuantizedMatrixType):
    """Plugin API 3's layer-side matrix, kept as a shim: ``QuantizedMatrix(weight)`` is the
    weight itself (a :class:`~vlite.core.weight_format.QuantizedWeight` has ``matmul(x)``,
    ``rows(row_ids, dtype)``, ``out_features``, ``in_features`` and ``narrow_rows``), and
    every quantized weight is an instance of it."""

    def __new__(cls, tensor: QuantizedWeight) -> QuantizedWeight:  # type: ignore[misc]
        return tensor


def builtin_weight_formats() -> dict[str, WeightFormat]:
    """The formats vlite ships, name -> instance (what a plan uses when given none)."""
    return {GGUF_FORMAT_NAME: GGUFBlockFormat()}


@dataclass(frozen=True)
class QuantizationPlan:
    """What ``quantization`` means for one model on one device.

    Attributes:
        setting: the ``quantization`` setting (``"auto"``, ``"gguf"`` or ``"none"``).
        kept: GGUF tensor type -> how many tensors stay quantized.
        dequantized: quantized GGUF type -> how many tensors are dequantized to the dtype.
        reason: why no tensor is kept, when none is.
        format_names: kept GGUF tensor type -> the name of the weight format keeping it.
        weight_formats: the formats the plan chose from, name -> instance.
    """

    setting: str
    kept: dict[str, int] = field(default_factory=dict)
    dequantized: dict[str, int] = field(default_factory=dict)
    reason: str | None = None
    format_names: dict[str, str] = field(default_factory=dict)
    weight_formats: dict[str, WeightFormat] = field(default_factory=dict, repr=False)

    @property
    def keep_types(self) -> frozenset[str]:
        return frozenset(self.kept)

    @property
    def formats(self) -> dict[str, WeightFormat]:
        """Kept GGUF tensor type -> the format instance that loads and computes it (what
        the GGUF loader is handed)."""
        return {t: self.weight_formats[name] for t, name in self.format_names.items()}

    def describe(self, dtype: torch.dtype) -> str:
        """One line for ``vlite run``/``serve``, e.g. ``GGUF Q4_1 x210, Q8_0 x1 kept
        quantized (weight-only CPU kernels)``; a format other than the built-in ``gguf`` is
        named."""
        dtype_name = str(dtype).removeprefix("torch.")
        if not self.kept:
            why = f" ({self.reason})" if self.reason else ""
            return f"none: weights in {dtype_name}{why}"
        groups = []
        for name in dict.fromkeys(self.format_names[t] for t in sorted(self.kept)):
            types = sorted(t for t in self.kept if self.format_names[t] == name)
            kept = ", ".join(f"{t} x{self.kept[t]}" for t in types)
            groups.append(f"{kept} kept quantized ({self._label(name, types)})")
        line = "GGUF " + "; ".join(groups)
        if self.dequantized:
            other = ", ".join(f"{n} x{c}" for n, c in sorted(self.dequantized.items()))
            line += f"; {other} dequantized to {dtype_name} (no kernel for these types)"
        return line

    def _label(self, name: str, types: list[str]) -> str:
        weight_format = self.weight_formats.get(name)
        description = getattr(weight_format, "description", "")
        if name == GGUF_FORMAT_NAME:
            activations = getattr(weight_format, "activations_line", None)
            line = activations(types) if callable(activations) else ""
            return (
                "; ".join(part for part in (description, line) if part) or f"weight format {name!r}"
            )
        return f"weight format {name!r}" + (f": {description}" if description else "")


def plan_quantization(
    setting: str,
    gguf_tensor_types: list[str] | None,
    device: Any,
    formats: Mapping[str, WeightFormat] | None = None,
) -> QuantizationPlan:
    """The :class:`QuantizationPlan` for a model whose tensors have ``gguf_tensor_types``.

    Each quantized type is kept by the first of ``formats`` that takes it
    (``tensor_types``) and can run on ``device`` (``unavailable_reason``); the others are
    dequantized.

    Args:
        setting: ``"auto"``, ``"gguf"`` or ``"none"``.
        gguf_tensor_types: the GGUF type name of every tensor, or ``None`` for a model
            that is not a GGUF file.
        device: the engine's ``torch.device``.
        formats: the weight formats to choose from, name -> instance, in order of
            preference (:func:`vlite.core.weight_format.registered_weight_formats` gives the
            registered ones); default: :func:`builtin_weight_formats`.

    Raises:
        ValueError: an unknown ``setting`` (the message lists the allowed values), or
            ``"gguf"`` where no weight can stay quantized (the message says why).
    """
    if setting not in QUANTIZATION_CHOICES:
        raise ConfigError(
            f"quantization={setting!r} is not supported; choose one of {QUANTIZATION_CHOICES}"
        )
    formats = dict(builtin_weight_formats() if formats is None else formats)
    plan = _plan(setting, gguf_tensor_types, torch.device(device), formats)
    if setting == "gguf" and not plan.kept:
        takes = "; ".join(
            f"{name}: {', '.join(sorted(fmt.tensor_types)) or 'none'}"
            for name, fmt in formats.items()
        )
        raise ConfigError(
            f"quantization='gguf' keeps a GGUF file's quantized weights in the weight formats "
            f"that take them ({takes or 'no weight format is registered'}), but here none "
            f"can be kept: {plan.reason}; use quantization='auto' (keep what can be kept) or "
            "'none'"
        )
    return plan


def _plan(
    setting: str,
    gguf_tensor_types: list[str] | None,
    device: torch.device,
    formats: dict[str, WeightFormat],
) -> QuantizationPlan:
    if gguf_tensor_types is None:
        return QuantizationPlan(setting, reason="not a GGUF file", weight_formats=formats)
    counts = Counter(gguf_tensor_types)
    quantized = {t: n for t, n in counts.items() if t not in _FLOAT_TYPES}
    # What a format could keep: the quantized types, and 16-bit floats a format takes.
    taken = set().union(*(fmt.tensor_types for fmt in formats.values()))
    keepable = {
        t: n for t, n in counts.items() if t not in _NEVER_KEPT and (t in quantized or t in taken)
    }
    if not keepable:
        return QuantizationPlan(
            setting, reason="the GGUF file holds no quantized tensor", weight_formats=formats
        )
    if setting == "none":
        return QuantizationPlan(setting, dequantized=quantized, reason="quantization='none'")
    taking = {name: fmt for name, fmt in formats.items() if keepable.keys() & fmt.tensor_types}
    unavailable = {name: fmt.unavailable_reason(device) for name, fmt in taking.items()}
    chosen: dict[str, str] = {}
    for name, fmt in taking.items():
        if unavailable[name] is None:
            for tensor_type in sorted(keepable.keys() & fmt.tensor_types):
                chosen.setdefault(tensor_type, name)
    kept = {t: n for t, n in keepable.items() if t in chosen}
    other = {t: n for t, n in quantized.items() if t not in chosen}
    reason = None
    if not kept:
        reasons = list(dict.fromkeys(r for r in unavailable.values() if r is not None))
        types = ", ".join(sorted(other))
        reason = "; ".join(reasons) or f"no tensor of a type with a kernel ({types})"
    return QuantizationPlan(setting, kept, other, reason, chosen, formats)
