"""Deliberately broken weight formats: WeightFormatConformance must fail on each.

Each is a small change to the built-in ``gguf`` format, of the kind a format author could
make by mistake. ``test_weight_format_suite_catches_bugs.py`` runs the suite on them.
"""

from __future__ import annotations

import torch

from vlite.core.hookspecs import hookimpl
from vlite.core.weight_format import check_group_sizes
from vlite.plugins.weight_formats.gguf import BLOCK_LAYOUTS, GGUFBlockFormat, GGUFBlockWeight

#: Every broken format takes only these types (the suite then runs fast).
TYPES = frozenset({"Q4_1", "Q8_0"})


class ByteOffsetColumnsFormat(GGUFBlockFormat):
    """Cuts columns at ``start // values`` *bytes* instead of blocks (forgets the block's
    size): a rank's column shard other than the first holds the wrong blocks."""

    tensor_types = TYPES

    def narrow(self, weight, dim, start, length):
        if dim in (-1, weight.ndim - 1) and start:
            layout = BLOCK_LAYOUTS[weight.qtype]
            count = length // layout.values * layout.nbytes
            blocks = weight.blocks.narrow(-1, start // layout.values, count).contiguous()
            return GGUFBlockWeight(weight.qtype, blocks, length, self)
        return super().narrow(weight, dim, start, length)


class LastBlockDroppingFormat(GGUFBlockFormat):
    """Multiplies by every block of a row but the last (an off-by-one in a product loop)."""

    tensor_types = TYPES

    def linear(self, weight, x):
        values = BLOCK_LAYOUTS[weight.qtype].values
        kept = weight.cols - values
        shortened = super().narrow(weight, 1, 0, kept)
        return super().linear(shortened, x[:, :kept].contiguous())


class RoundingDownSliceFormat(GGUFBlockFormat):
    """Rounds a column slice off the blocks down to the blocks instead of refusing it."""

    tensor_types = TYPES

    def narrow(self, weight, dim, start, length):
        if dim in (-1, weight.ndim - 1):
            values = BLOCK_LAYOUTS[weight.qtype].values
            start, length = start // values * values, max(length // values, 1) * values
        return super().narrow(weight, dim, start, length)


class FirstExpertOnlyFormat(GGUFBlockFormat):
    """Runs every group of rows through the first expert."""

    tensor_types = TYPES

    def expert_linear(self, weight, x, group_sizes):
        check_group_sizes(weight, x, group_sizes)
        first = super().narrow(weight, 0, 0, 1)
        matrix = GGUFBlockWeight(first.qtype, first.blocks[0], first.cols, self)
        if x.shape[0] == 0:
            return torch.empty(0, weight.shape[1])
        return super().linear(matrix, x)


class Plugin:
    """Registers one broken format (one per plugin: the quantization plan would otherwise
    keep a type in the first of them only)."""

    def __init__(self, name: str, cls: type) -> None:
        self.name, self.cls = name, cls

    @hookimpl
    def register_weight_formats(self, register) -> None:
        register(self.name, self.cls)


PLUGINS = {
    name: Plugin(name, cls)
    for name, cls in {
        "byte-offset-columns": ByteOffsetColumnsFormat,
        "last-block-dropping": LastBlockDroppingFormat,
        "rounding-down-slice": RoundingDownSliceFormat,
        "first-expert-only": FirstExpertOnlyFormat,
    }.items()
}
