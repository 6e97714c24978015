"""LongRoPE scaling (``rope_type="longrope"``): Phi-3-128k, Phi-3.5 and Phi-4-mini.

LongRoPE keeps two sets of per-dimension rescale factors. The inverse frequency of rotated
pair ``i`` is ``theta ** (-2i / rotary_dim) / factor[i]``, with ``short_factor`` while a
sequence fits the pre-training context (``original_max_position_embeddings``) and
``long_factor`` once it is longer. Both sets scale cos and sin by one
``attention_factor``: the configured one, else ``sqrt(1 + ln(s) / ln(original_max))``
for the context extension ``s`` (the configured ``factor``, else
``max_position_embeddings / original_max``), and 1 when ``s <= 1``.

Which set a token uses follows transformers' Phi-3 generation: the logits of a sequence of
``n`` known tokens come from a pass that rotates *every* token with the long factors when
``n > original_max`` and with the short ones otherwise. When a sequence outgrows the
original context its cached keys are therefore recomputed once with the long factors (see
:class:`~vlite.worker.model_runner.ModelRunner`). Prompt chunks and recomputation after
preemption use the set of the sequence's known length, so scheduling does not change the
tokens. Prefix-cache blocks do not record their set: mixing short and long sequences that
share cached blocks is not exact.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from vlite.core.errors import ConfigError


@dataclass(frozen=True)
class LongRope:
    """LongRoPE settings for ``rotary_dim`` rotated dimensions.

    Attributes:
        short_factor: ``rotary_dim // 2`` divisors of the inverse frequencies, for
            sequences of at most ``original_max_position_embeddings`` tokens.
        long_factor: the same for longer sequences.
        original_max_position_embeddings: the pre-training context length.
        attention_factor: the scale of cos and sin (both sets).
    """

    short_factor: tuple[float, ...]
    long_factor: tuple[float, ...]
    original_max_position_embeddings: int
    attention_factor: float

    @classmethod
    def from_scaling(
        cls, scaling: Mapping[str, Any], rotary_dim: int, max_position_embeddings: int
    ) -> LongRope:
        """Read the scaling dict of a ``longrope`` config (see
        :func:`~vlite.models.rope.rope_parameters_from_config`).

        Raises:
            ValueError: a key is missing, or a factor list does not have ``rotary_dim // 2``
                entries.
        """
        missing = [
            key
            for key in ("short_factor", "long_factor", "original_max_position_embeddings")
            if scaling.get(key) is None
        ]
        if missing:
            raise ConfigError(f"rope_type='longrope' needs {missing} in the config's rope settings")
        short = _factor_list(scaling, "short_factor", rotary_dim)
        long = _factor_list(scaling, "long_factor", rotary_dim)
        original_max = int(scaling["original_max_position_embeddings"])
        attention_factor = scaling.get("attention_factor")
        if attention_factor is None:
            extension = scaling.get("factor") or max_position_embeddings / original_max
            attention_factor = default_attention_factor(extension, original_max)
        return cls(short, long, original_max, float(attention_factor))

    def uses_long_factors(self, num_tokens: int) -> bool:
        """Whether a sequence of ``num_tokens`` known tokens is rotated with the long factors."""
        return num_tokens > self.original_max_position_embeddings

    def inv_freq(self, theta: float, long: bool) -> torch.Tensor:
        """``[rotary_dim // 2]`` float32 inverse frequencies of the short or long set."""
        factors = torch.tensor(self.long_factor if long else self.short_factor, dtype=torch.float32)
        rotary_dim = 2 * len(factors)
        exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).to(torch.float32)
        return 1.0 / (factors * theta ** (exponents / rotary_dim))


def default_attention_factor(extension: float, original_max_position_embeddings: int) -> float:
    """The cos/sin scale LongRoPE uses when the config gives none, for a context ``extension``
    times the pre-training one."""
    if extension <= 1.0:
        return 1.0
    return math.sqrt(1.0 + math.log(extension) / math.log(original_max_position_embeddings))


def _factor_list(scaling: Mapping[str, Any], key: str, rotary_dim: int) -> tuple[float, ...]:
    values: Sequence[float] = scaling[key]
    if len(values) != rotary_dim // 2:
        raise ConfigError(
            f"LongRoPE {key} has {len(values)} entries; it needs rotary_dim // 2 = "
            f"{rotary_dim // 2} (one per rotated pair of the {rotary_dim} rotated dimensions)"
        )
    return tuple(float(value) for value in values)
