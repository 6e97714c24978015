"""The weight-format plugin interface: matrices kept in a stored encoding (quantized).

A *weight format* (registered with ``register_weight_formats``) owns the tensors of some
stored types — GGUF's block-quantized ``Q4_0``, ``Q8_0``, ... — from the file to the
product: it loads a tensor's bytes into a :class:`QuantizedWeight`, cuts and joins weights
for tensor parallelism and fused layers, multiplies activations by them, gathers embedding
rows, runs a mixture's experts, and dequantizes. Layers hold the weight object and call its
format; they never look inside it.

Shapes. A weight is a matrix ``W`` ``[N, K]`` (``N`` output features, its rows; ``K`` input
features, its columns) or a stack of ``E`` expert matrices ``[E, N, K]``. A stored row is a
run of whole blocks of ``block_values(tensor_type)`` columns (1 for a type without blocks),
so rows (and experts) can be cut anywhere, columns only on block boundaries.

Which format keeps which tensor is the quantization plan's choice
(``vlite.models.quantization.plan_quantization``): for each stored type, the first format
in :func:`registered_weight_formats`'s order that takes the type and can run on the device.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, ClassVar

import torch

from vlite.core.errors import VliteError


class WeightFormatError(VliteError, ValueError):
    """A weight a format cannot hold or cut as asked: an unknown tensor type, a shape its
    bytes do not fit, weights of different types joined. The message names the tensor type,
    the value and what is allowed."""


class BlockAlignmentError(WeightFormatError):
    """A row length, column slice or column width that does not fall on whole blocks of its
    tensor type (the message names the type and its values per block)."""


class QuantizedWeight(ABC):
    """A weight held in a format's encoding: ``[N, K]``, or ``[E, N, K]`` stacked experts.

    A format subclasses it for its own weights. Layers read :attr:`shape`,
    :attr:`tensor_type` and :attr:`nbytes` and compute through the methods below, which
    all go through :attr:`format` (they are conveniences: a format implements the work in
    its :class:`WeightFormat` methods).
    """

    @property
    @abstractmethod
    def format(self) -> WeightFormat:
        """The format whose methods operate on this weight."""

    @property
    @abstractmethod
    def tensor_type(self) -> str:
        """The stored type (a GGUF type name such as ``"Q4_1"``)."""

    @property
    @abstractmethod
    def shape(self) -> tuple[int, ...]:
        """``(N, K)`` for a matrix, ``(E, N, K)`` for stacked experts (logical values)."""

    @property
    @abstractmethod
    def nbytes(self) -> int:
        """Bytes of memory the weight holds (what a memory report sums)."""

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def block_values(self) -> int:
        """Columns per block: column slices start and end on multiples of it."""
        return self.format.block_values(self.tensor_type)

    def dequantize(self) -> torch.Tensor:
        """The weight as a new float32 tensor of :attr:`shape`."""
        return self.format.dequantize(self)

    def narrow(self, dim: int, start: int, length: int) -> QuantizedWeight:
        """Indices ``start:start + length`` of dimension ``dim`` (see
        :meth:`WeightFormat.narrow`)."""
        return self.format.narrow(self, dim, start, length)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W^T``: ``x`` ``[..., K]`` of any float dtype -> ``[..., N]`` in ``x.dtype``
        (computed in float32 by :meth:`WeightFormat.linear`)."""
        if x.dim() == 2 and x.dtype == torch.float32:  # the decode path: no extra op
            return self.format.linear(self, x)
        in_features, out_features = self.shape[-1], self.shape[-2]
        flat = x.reshape(-1, in_features)
        out = self.format.linear(self, flat if flat.dtype == torch.float32 else flat.float())
        return out.to(x.dtype).view(*x.shape[:-1], out_features)

    @property
    def out_features(self) -> int:
        """``N``: rows of the matrix (of each expert's)."""
        return self.shape[-2]

    @property
    def in_features(self) -> int:
        """``K``: columns of the matrix."""
        return self.shape[-1]

    def narrow_rows(self, start: int, length: int) -> QuantizedWeight:
        """Rows ``start:start + length`` of a matrix."""
        return self.narrow(0, start, length)

    def rows(self, row_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows ``row_ids`` ``[T]`` of a matrix as ``[T, K]`` in ``dtype`` (an embedding
        lookup, by :meth:`WeightFormat.embedding`)."""
        return self.format.embedding(self, row_ids.long()).to(dtype)

    def __repr__(self) -> str:
        name = type(self).__name__
        return f"{name}({self.tensor_type}, shape={list(self.shape)}, nbytes={self.nbytes})"


class WeightFormat(ABC):
    """A weight-format plugin: how the tensors of its stored types load, shard and compute.

    Constructed with no arguments; one instance may serve every layer of a model (keep
    per-weight state in the :class:`QuantizedWeight` objects). Activations, outputs and
    dequantized values are float32 on the device the format runs on.

    Attributes:
        tensor_types: the stored types the format takes (GGUF type names, e.g. ``"Q4_0"``).
        description: a few words for the quantization plan's line (``vlite run`` prints it),
            e.g. ``"weight-only CPU kernels"``.
    """

    tensor_types: ClassVar[frozenset[str]] = frozenset()
    description: ClassVar[str] = ""

    def configure(self, config: Any) -> None:
        """Read the engine's settings (a :class:`~vlite.core.config.VliteConfig`) before
        loading or computing anything; called once per instance by
        :func:`registered_weight_formats`. Default: nothing (plugin API 5)."""
        return None

    def unavailable_reason(self, device: torch.device) -> str | None:
        """Why the format cannot compute on ``device`` here (no kernel for that device, a
        kernel that does not build), or ``None`` when it can. The plan then dequantizes what
        the format would have kept, naming this reason when nothing is kept. Default: it can."""
        return None

    @abstractmethod
    def block_values(self, tensor_type: str) -> int:
        """Columns per stored block of ``tensor_type`` (1: any column slice). A row's length
        and a column slice's start and length must be multiples of it."""

    @abstractmethod
    def load(self, tensor_type: str, data: torch.Tensor, shape: tuple[int, int]) -> QuantizedWeight:
        """A stored matrix as a weight.

        Args:
            tensor_type: one of :attr:`tensor_types`.
            data: the tensor's bytes as stored, one row per matrix row: a contiguous CPU
                ``uint8`` tensor ``[N, row_bytes]`` (a fresh copy: the weight may keep it).
            shape: ``(N, K)``, the matrix's logical shape.

        Raises:
            WeightFormatError: a type the format does not take, or bytes that do not hold a
                ``[N, K]`` matrix of the type (:class:`BlockAlignmentError` when ``K`` is
                not a multiple of :meth:`block_values`).
        """

    @abstractmethod
    def narrow(self, weight: QuantizedWeight, dim: int, start: int, length: int) -> QuantizedWeight:
        """Indices ``start:start + length`` of dimension ``dim`` of ``weight`` (negative
        ``dim`` counts from the end), as tensor parallelism cuts weights: experts and rows
        anywhere, columns (the last dimension) only on whole blocks.

        Raises:
            BlockAlignmentError: a column slice whose start or length is not a multiple of
                :meth:`block_values` (the message names the type and the block size).
            WeightFormatError: a dimension or range outside the weight.
        """

    @abstractmethod
    def cat_rows(self, weights: Sequence[QuantizedWeight]) -> QuantizedWeight:
        """The matrices ``weights`` (``[N_i, K]`` each, one type, one ``K``) stacked
        row-wise into ``[sum(N_i), K]``, e.g. q/k/v into a fused qkv. The result owns its
        memory (it holds no view of the inputs), also for a single weight.

        Raises:
            WeightFormatError: no weights, or weights of different types, widths or ranks.
        """

    @abstractmethod
    def stack(self, weights: Sequence[QuantizedWeight]) -> QuantizedWeight:
        """``E`` matrices ``[N, K]`` of one type as stacked experts ``[E, N, K]`` (owning
        its memory).

        Raises:
            WeightFormatError: no weights, or weights of different types or shapes.
        """

    @abstractmethod
    def dequantize(self, weight: QuantizedWeight) -> torch.Tensor:
        """The weight as a new float32 tensor of ``weight.shape``: exactly the values the
        products below compute with."""

    @abstractmethod
    def linear(self, weight: QuantizedWeight, x: torch.Tensor) -> torch.Tensor:
        """``x @ W^T``: ``x`` ``[M, K]`` float32 (``M`` may be 0) and a matrix ``W``
        ``[N, K]`` -> ``[M, N]`` float32."""

    @abstractmethod
    def embedding(self, weight: QuantizedWeight, row_ids: torch.Tensor) -> torch.Tensor:
        """Rows ``row_ids`` (``[T]`` int64, each in ``[0, N)``) of a matrix ``[N, K]`` as
        ``[T, K]`` float32."""

    @abstractmethod
    def expert_linear(
        self, weight: QuantizedWeight, x: torch.Tensor, group_sizes: Sequence[int]
    ) -> torch.Tensor:
        """The grouped product of a mixture's experts: ``weight`` ``[E, N, K]``, ``x``
        ``[M, K]`` float32 with its rows grouped by expert — the first ``group_sizes[0]``
        rows go to expert 0, the next ``group_sizes[1]`` to expert 1, ... (``E`` sizes,
        each >= 0, summing to ``M``) -> ``[M, N]`` float32, row ``i`` being
        ``x[i] @ W[e]^T`` for its expert ``e``."""


def check_group_sizes(weight: QuantizedWeight, x: torch.Tensor, group_sizes: Sequence[int]):
    """Raise ``ValueError`` unless ``group_sizes`` splits ``x``'s rows over ``weight``'s
    experts (a caller's bug, so not a :class:`WeightFormatError`)."""
    num_experts = weight.shape[0]
    if (
        weight.ndim != 3
        or len(group_sizes) != num_experts
        or any(size < 0 for size in group_sizes)
        or sum(group_sizes) != x.shape[0]
    ):
        raise ValueError(
            f"expert_linear needs stacked experts [E, N, K] and E group sizes >= 0 summing to "
            f"the {x.shape[0]} rows of x; got weight {list(weight.shape)} and group sizes "
            f"{list(group_sizes)}"
        )


def joinable(weights: Sequence[Any]) -> bool:
    """Whether ``weights`` can be joined by their format's :meth:`WeightFormat.cat_rows`:
    all quantized weights of one format class and type, of one rank and one width."""
    if not weights or not all(isinstance(w, QuantizedWeight) for w in weights):
        return False
    first = weights[0]
    return all(
        type(w.format) is type(first.format)
        and w.tensor_type == first.tensor_type
        and w.ndim == first.ndim
        and w.shape[-1] == first.shape[-1]
        for w in weights
    )


def registered_weight_formats(registry: Any, config: Any = None) -> dict[str, WeightFormat]:
    """Every weight format ``registry`` (a :class:`~vlite.core.plugins.PluginRegistry`)
    holds, constructed (and given ``config``, a :class:`~vlite.core.config.VliteConfig`, by
    :meth:`WeightFormat.configure` when one is passed), name -> instance, in the order the
    quantization plan prefers them: installed plugins' formats first (in the order they
    registered), vlite's built-in ones last, so that an installed format replaces a built-in
    one for the types both take."""
    entries = [entry for entry in registry.entries() if entry.kind == "weight_format"]
    ordered = [e for e in entries if e.package != "vlite"] + [
        e for e in entries if e.package == "vlite"
    ]
    formats = {entry.name: entry.obj() for entry in ordered}
    if config is not None:
        for weight_format in formats.values():
            weight_format.configure(config)
    return formats
