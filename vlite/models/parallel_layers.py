"""Tensor-parallel layers: linears and an LM head that each hold one rank's share.

Megatron-style split of a transformer block over ``world_size`` ranks:

- :class:`ColumnParallelLinear` splits *output* features; a fused projection (q/k/v,
  gate/up) splits each of its pieces separately, so every rank holds whole heads and
  matching gate/up rows, and its output needs no communication;
- :class:`RowParallelLinear` splits *input* features (it consumes a column-parallel
  output), so each rank computes a partial sum that is all-reduced; its bias is added
  once, after the reduce;
- :class:`VocabParallelLMHead` splits the vocabulary and all-gathers the logits, so every
  rank holds the full ``[n, vocab_size]`` logits (and can sample by itself).

Each layer loads *full* Hugging Face tensors and keeps its rank's slice
(:class:`ShardedModule`), so a loader never needs to know how a layer is split. At world
size 1 every layer computes exactly what ``nn.Linear`` computes, with no collective.

A weight may also arrive quantized (a weight format's
:class:`~vlite.core.weight_format.QuantizedWeight`, e.g. a GGUF file's blocks): the layer
then keeps its slice, cut by the format, as :attr:`ShardedModule.quantized`, drops its
float ``weight`` parameter, and computes through the format. A fused layer does so when
every piece arrives quantized: pieces of one format and type are joined into one weight,
pieces of several (a K-quant mix's ``attn_v`` beside its ``attn_q``) are kept as a
:class:`~vlite.models.mixed_pieces.MixedPieces`; a fused layer with a float piece among
quantized ones dequantizes them into the float weight. A row-parallel layer's columns are
cut only on whole blocks of the type: where a rank's share would split one, the weight is
dequantized.
"""

from __future__ import annotations

from abc import abstractmethod

import torch
import torch.nn.functional as F
from torch import nn

from vlite.core.errors import ConfigError
from vlite.core.weight_format import QuantizedWeight
from vlite.distributed.parallel_state import SINGLE_RANK, TensorParallelGroup
from vlite.models.mixed_pieces import MixedPieces

#: A full tensor handed to :meth:`ShardedModule.load_full`.
FullTensor = torch.Tensor | QuantizedWeight


class ShardedModule(nn.Module):
    """A module whose parameters are slices of full (Hugging Face-shaped) tensors.

    ``leaf`` is a parameter's own name (``"weight"``, ``"bias"``); ``piece`` names one part
    of a fused parameter (``"q"``, ``"gate"``) or is ``None`` for an unfused one.
    """

    #: The parts of a fused parameter, in their order along the output dim (``()``: unfused).
    piece_names: tuple[str, ...] = ()

    @abstractmethod
    def full_shape(self, leaf: str, piece: str | None = None) -> tuple[int, ...]:
        """Shape of the full tensor of ``leaf`` (of one ``piece`` of it, when given)."""

    @abstractmethod
    def load_full(self, leaf: str, tensor: FullTensor, piece: str | None = None) -> None:
        """Copy this rank's slice of the full ``tensor`` (shaped by :meth:`full_shape`)."""

    #: The weight in its weight format, once every piece arrived quantized (then ``weight``
    #: is ``None``; pieces of several types: a MixedPieces); a memory report sums its
    #: ``nbytes``.
    quantized: QuantizedWeight | MixedPieces | None = None

    def _store_weight_piece(
        self, piece: str | None, local: FullTensor, rows: slice | None = None
    ) -> None:
        """Keep this rank's ``local`` slice of one weight piece (rows ``rows`` of the weight).

        Float slices are copied into ``weight`` at once; quantized slices wait until every
        piece has come, then are joined by their format into :attr:`quantized` (all
        quantized, one format and type) or are dequantized into ``weight``.
        """
        if not hasattr(self, "_pending_pieces"):
            self._pending_pieces: dict[str | None, tuple[FullTensor, slice | None]] = {}
        self._pending_pieces[piece] = (local, rows)
        if set(self._pending_pieces) != set(self.piece_names or (None,)):
            return
        pending = [self._pending_pieces[name] for name in self.piece_names or (None,)]
        del self._pending_pieces
        pieces = [tensor for tensor, _ in pending]
        if all(isinstance(piece, QuantizedWeight) for piece in pieces):
            self.quantized = MixedPieces.join(pieces)  # owns its memory
            self.weight = None
            return
        for tensor, target_rows in pending:
            if isinstance(tensor, QuantizedWeight):
                tensor = tensor.dequantize()
            target = self.weight.data if target_rows is None else self.weight.data[target_rows]
            target.copy_(tensor)


def _check_shape(tensor: torch.Tensor, expected: tuple[int, ...]) -> None:
    if tuple(tensor.shape) != expected:
        raise ConfigError(f"shape {tuple(tensor.shape)} does not match expected {expected}")


class ColumnParallelLinear(ShardedModule):
    """``y = x W^T + b`` with output features split over the ranks, piece by piece.

    Args:
        input_size: input features (every rank sees all of them).
        output_sizes: full output features of each piece, in order, e.g.
            ``{"q": q_size, "k": kv_size, "v": kv_size}``; each must split evenly.
        bias: whether there is a bias (split like the output).
        tp_group: the ranks to split over.

    The local weight is ``[sum(output_sizes) / world_size, input_size]``: this rank's rows
    of each piece, concatenated in piece order.
    """

    def __init__(
        self,
        input_size: int,
        output_sizes: dict[str, int],
        bias: bool,
        tp_group: TensorParallelGroup = SINGLE_RANK,
    ) -> None:
        super().__init__()
        self.tp_group = tp_group
        self.input_size = input_size
        self.output_sizes = dict(output_sizes)
        self.piece_names = tuple(output_sizes)
        self.local_sizes = {
            name: size // tp_group.world_size for name, size in output_sizes.items()
        }
        for size in output_sizes.values():
            tp_group.shard_range(size)  # raises when the piece does not split evenly
        local_total = sum(self.local_sizes.values())
        self.weight = nn.Parameter(torch.empty(local_total, input_size))
        self.bias = nn.Parameter(torch.empty(local_total)) if bias else None

    def local_slices(self) -> dict[str, slice]:
        """Rows of the local weight (and bias) that hold each piece."""
        slices, start = {}, 0
        for name, size in self.local_sizes.items():
            slices[name] = slice(start, start + size)
            start += size
        return slices

    def full_shape(self, leaf: str, piece: str | None = None) -> tuple[int, ...]:
        rows = sum(self.output_sizes.values()) if piece is None else self.output_sizes[piece]
        return (rows, self.input_size) if leaf == "weight" else (rows,)

    def load_full(self, leaf: str, tensor: FullTensor, piece: str | None = None) -> None:
        """Load one piece (``piece`` given) or the whole fused tensor (``piece=None``)."""
        _check_shape(tensor, self.full_shape(leaf, piece))
        pieces = self.piece_names if piece is None else (piece,)
        full_start = 0
        for name in pieces:
            full_piece = (
                tensor
                if piece is not None
                else tensor.narrow(0, full_start, self.output_sizes[name])
            )
            full_start += self.output_sizes[name]
            start, end = self.tp_group.shard_range(self.output_sizes[name])
            local = full_piece.narrow(0, start, end - start)
            if leaf == "weight":
                self._store_weight_piece(name, local, self.local_slices()[name])
            else:
                getattr(self, leaf).data[self.local_slices()[name]].copy_(local)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, input_size]`` -> ``[T, sum(output_sizes) / world_size]``."""
        if self.quantized is None:
            return F.linear(x, self.weight, self.bias)
        out = self.quantized.matmul(x)
        return out if self.bias is None else out + self.bias


class RowParallelLinear(ShardedModule):
    """``y = x W^T + b`` with input features split over the ranks and the result all-reduced.

    Args:
        input_size: full input features; this rank receives ``input_size / world_size`` of
            them (the output of a :class:`ColumnParallelLinear`).
        output_size: output features (every rank gets all of them).
        bias: whether there is a bias (replicated, added once after the reduce).
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        bias: bool,
        tp_group: TensorParallelGroup = SINGLE_RANK,
    ) -> None:
        super().__init__()
        self.tp_group = tp_group
        self.input_size = input_size
        self.output_size = output_size
        self.is_parallel = tp_group.is_parallel  # read per call: a plain attribute
        self.input_start, input_end = tp_group.shard_range(input_size)
        self.weight = nn.Parameter(torch.empty(output_size, input_end - self.input_start))
        self.bias = nn.Parameter(torch.empty(output_size)) if bias else None

    def full_shape(self, leaf: str, piece: str | None = None) -> tuple[int, ...]:
        return (self.output_size, self.input_size) if leaf == "weight" else (self.output_size,)

    def load_full(self, leaf: str, tensor: FullTensor, piece: str | None = None) -> None:
        _check_shape(tensor, self.full_shape(leaf))
        if leaf != "weight":
            getattr(self, leaf).data.copy_(tensor)
            return
        width = self.weight.shape[1]
        if isinstance(tensor, QuantizedWeight) and (
            self.input_start % tensor.block_values or width % tensor.block_values
        ):
            tensor = tensor.dequantize()  # this rank's columns split a block
        self._store_weight_piece(None, tensor.narrow(1, self.input_start, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, input_size / world_size]`` -> ``[T, output_size]`` (summed over ranks)."""
        if self.quantized is not None:
            out = self.quantized.matmul(x)
            if self.is_parallel:
                out = self.tp_group.all_reduce(out)
            return out if self.bias is None else out + self.bias
        if not self.is_parallel:
            return F.linear(x, self.weight, self.bias)
        out = self.tp_group.all_reduce(F.linear(x, self.weight))
        return out if self.bias is None else out + self.bias


class VocabParallelLMHead(ShardedModule):
    """The output projection, with vocabulary rows split over the ranks.

    Each rank holds ``ceil(vocab_size / world_size)`` rows (the last rank fewer when the
    vocabulary does not split evenly; its logits are padded before the gather). With tied
    embeddings the module owns no weight: :meth:`forward` takes the embedding matrix and
    uses this rank's rows of it.
    """

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        has_weight: bool,
        tp_group: TensorParallelGroup = SINGLE_RANK,
    ) -> None:
        super().__init__()
        self.tp_group = tp_group
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.is_parallel = tp_group.is_parallel
        self.rows_per_rank = -(-vocab_size // tp_group.world_size)
        self.vocab_start = min(tp_group.rank * self.rows_per_rank, vocab_size)
        self.vocab_end = min(self.vocab_start + self.rows_per_rank, vocab_size)
        if has_weight:
            self.weight = nn.Parameter(torch.empty(self.vocab_end - self.vocab_start, hidden_size))
        else:
            self.weight = None

    def full_shape(self, leaf: str, piece: str | None = None) -> tuple[int, ...]:
        return (self.vocab_size, self.hidden_size)

    def load_full(self, leaf: str, tensor: FullTensor, piece: str | None = None) -> None:
        _check_shape(tensor, self.full_shape(leaf))
        rows = self.vocab_end - self.vocab_start
        self._store_weight_piece(None, tensor.narrow(0, self.vocab_start, rows))

    def forward(
        self, hidden: torch.Tensor, tied_weight: torch.Tensor | QuantizedWeight | None = None
    ) -> torch.Tensor:
        """``[n, hidden_size]`` -> ``[n, vocab_size]`` float32 logits, full on every rank.

        ``tied_weight`` is the full ``[vocab_size, hidden_size]`` embedding (a tensor, or
        its :class:`~vlite.core.weight_format.QuantizedWeight`) when the head owns no
        weight.
        """
        if tied_weight is None:
            weight = self.weight if self.quantized is None else self.quantized
        elif self.is_parallel:
            weight = _rows(tied_weight, self.vocab_start, self.vocab_end)
        else:
            weight = tied_weight
        if not self.is_parallel:
            return _linear(hidden, weight).float()
        local = _linear(hidden, weight)
        missing = self.rows_per_rank - local.shape[-1]
        if missing:
            local = F.pad(local, (0, missing))
        return self.tp_group.all_gather(local, dim=-1)[:, : self.vocab_size].float()


class VocabEmbedding(ShardedModule):
    """Token embedding ``[vocab_size, hidden_size]``, replicated on every rank.

    Like ``nn.Embedding`` (its ``weight`` is the table), and it may keep a block-quantized
    table (:attr:`quantized`), which a tied LM head then shares.
    """

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size))
        self._dtype = self.weight.dtype

    def full_shape(self, leaf: str, piece: str | None = None) -> tuple[int, ...]:
        return (self.vocab_size, self.hidden_size)

    def load_full(self, leaf: str, tensor: FullTensor, piece: str | None = None) -> None:
        _check_shape(tensor, self.full_shape(leaf))
        self._store_weight_piece(None, tensor)

    @property
    def table(self) -> torch.Tensor | QuantizedWeight:
        """The ``[vocab_size, hidden_size]`` table, dense or quantized."""
        return self.weight if self.quantized is None else self.quantized

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        """``[T]`` ids -> ``[T, hidden_size]`` in the model dtype."""
        if self.quantized is None:
            return F.embedding(token_ids, self.weight)
        return self.quantized.rows(token_ids, self._dtype)

    def _apply(self, fn, recurse=True):  # follow .to(dtype) for the quantized lookup's dtype
        result = super()._apply(fn, recurse)
        if self.weight is not None:
            self._dtype = self.weight.dtype
        return result


def _linear(x: torch.Tensor, weight: torch.Tensor | QuantizedWeight) -> torch.Tensor:
    if isinstance(weight, QuantizedWeight):
        return weight.matmul(x)
    return F.linear(x, weight)


def _rows(weight: torch.Tensor | QuantizedWeight, start: int, end: int):
    if isinstance(weight, QuantizedWeight):
        return weight.narrow(0, start, end - start)
    return weight[start:end]
