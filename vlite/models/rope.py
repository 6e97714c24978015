"""Rotary position embedding (RoPE), "rotate half" (GPT-NeoX) layout as Llama uses it.

The rotated dimensions are split in two halves ``x1 | x2``; pair ``(x1[i], x2[i])`` is
rotated by angle ``position * inv_freq[i]``. With ``partial_rotary_factor < 1`` (Phi-4-mini,
for instance) only the first ``rotary_dim = head_dim * factor`` dimensions of each head are
rotated and the rest pass through. cos/sin are precomputed once in float32 for every
position up to ``max_position_embeddings`` and looked up by position at each step.

LongRoPE (:mod:`vlite.models.longrope`) keeps two tables in the one cache: the short
factors' rows for positions below ``original_max_position_embeddings``, then the long
factors' rows for every position; a per-token flag picks the table (see
:meth:`RotaryEmbedding.cache_rows`).

RoPE settings are read from a Hugging Face config in either spelling:

- transformers >= 5: ``config.rope_parameters = {"rope_theta": ..., "rope_type": ..., ...}``
  (the legacy ``rope_scaling`` attribute is an alias of the same dict, and ``rope_theta``
  is no longer an attribute of the config);
- transformers 4.x: ``config.rope_theta`` plus an optional ``config.rope_scaling`` dict.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from vlite.core.errors import ConfigError
from vlite.models.longrope import LongRope

_DEFAULT_THETA = 10000.0


@dataclass(frozen=True)
class RopeParameters:
    """Normalised RoPE settings.

    Attributes:
        rope_theta: base of the geometric frequency progression.
        rope_type: ``"default"``, ``"llama3"`` or ``"longrope"``.
        scaling: the extra keys of the scaling dict (``factor``, ``low_freq_factor``,
            ``high_freq_factor``, ``original_max_position_embeddings`` for llama3;
            ``short_factor``, ``long_factor``, ``original_max_position_embeddings`` and
            maybe ``factor``/``attention_factor`` for longrope).
        partial_rotary_factor: the fraction of each head's dimensions that is rotated.
    """

    rope_theta: float
    rope_type: str
    scaling: dict[str, Any]
    partial_rotary_factor: float = 1.0


def rope_parameters_from_config(config: Any, layer_type: str = "full_attention") -> RopeParameters:
    """Read RoPE settings from a ``transformers`` config of either major version.

    ``layer_type`` picks the settings of one kind of layer where a config has several
    (Gemma 3: ``"sliding_attention"`` layers rotate with ``rope_local_base_freq``, unscaled).
    """
    params = getattr(config, "rope_parameters", None)
    if not params:
        params = dict(getattr(config, "rope_scaling", None) or {})
        if getattr(config, "rope_theta", None) is not None:
            params["rope_theta"] = config.rope_theta
        local_theta = getattr(config, "rope_local_base_freq", None)
        if layer_type == "sliding_attention" and local_theta is not None:
            params = {"rope_theta": local_theta}  # transformers 4's Gemma 3 spelling
    params = dict(params)
    if isinstance(params.get(layer_type), dict):
        # Per-layer-type form ({"full_attention": {...}, "sliding_attention": {...}}).
        params = dict(params[layer_type])
    elif isinstance(params.get("full_attention"), dict):
        params = dict(params["full_attention"])
    theta = params.pop("rope_theta", None)
    if theta is None:
        theta = getattr(config, "rope_theta", None) or _DEFAULT_THETA
    # Some older checkpoints spell the key "type".
    legacy_type = params.pop("type", None)
    rope_type = params.pop("rope_type", None) or legacy_type or "default"
    partial = params.pop("partial_rotary_factor", None)
    partial = partial or getattr(config, "partial_rotary_factor", None) or 1.0
    if not 0.0 < partial <= 1.0:
        raise ConfigError(f"partial_rotary_factor={partial} is invalid: must be in (0, 1]")
    if rope_type == "longrope":
        params["original_max_position_embeddings"] = _longrope_original_max(config, params)
    return RopeParameters(float(theta), rope_type, params, float(partial))


def _longrope_original_max(config: Any, params: dict[str, Any]) -> int:
    """The pre-training context of a LongRoPE config. Phi-3 configs keep it on the config
    itself (transformers 4's only place), which wins over the rope dict as in transformers;
    without either, the model's positions."""
    for value in (
        getattr(config, "original_max_position_embeddings", None),
        params.get("original_max_position_embeddings"),
        getattr(config, "max_position_embeddings", None),
    ):
        if value is not None:
            return int(value)
    raise ConfigError(
        "rope_type='longrope' needs original_max_position_embeddings (or "
        "max_position_embeddings) in the config"
    )


def default_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    """``[head_dim // 2]`` float32 inverse frequencies ``theta ** (-2i / head_dim)``."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    return 1.0 / (theta**exponents)


def llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Apply Llama 3.1 frequency scaling to ``[head_dim // 2]`` inverse frequencies.

    Long wavelengths (beyond ``original_max_position_embeddings / low_freq_factor``) are
    divided by ``factor``; short ones (below ``... / high_freq_factor``) are kept; the band
    between is interpolated linearly in ``original_max / wavelength``.
    """
    factor = float(scaling["factor"])
    low_freq_factor = float(scaling["low_freq_factor"])
    high_freq_factor = float(scaling["high_freq_factor"])
    original_max = float(scaling["original_max_position_embeddings"])
    low_freq_wavelen = original_max / low_freq_factor
    high_freq_wavelen = original_max / high_freq_factor

    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (original_max / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def compute_inv_freq(head_dim: int, rope: RopeParameters) -> torch.Tensor:
    """``[head_dim // 2]`` float32 inverse frequencies for the configured rope type."""
    inv_freq = default_inv_freq(head_dim, rope.rope_theta)
    if rope.rope_type == "default":
        return inv_freq
    if rope.rope_type == "llama3":
        return llama3_inv_freq(inv_freq, rope.scaling)
    if rope.rope_type == "linear":  # positions divided by the factor
        return inv_freq / float(rope.scaling["factor"])
    if rope.rope_type == "longrope":
        raise ValueError(
            "rope_type='longrope' has two sets of inverse frequencies (LongRope.inv_freq), "
            "built into one table by RotaryEmbedding"
        )
    raise ConfigError(
        f"rope_type={rope.rope_type!r} is not supported by vlite yet (supported: 'default', "
        "'linear', 'llama3', 'longrope')"
    )


def cos_sin_tables(
    inv_freq: torch.Tensor, num_positions: int, scale: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """``scale * cos`` and ``scale * sin`` of ``position * inv_freq``, each
    ``[num_positions, len(inv_freq)]`` float32, for positions ``0 .. num_positions - 1``."""
    positions = torch.arange(num_positions, dtype=torch.int64).to(torch.float32)
    freqs = torch.outer(positions, inv_freq)
    return freqs.cos() * scale, freqs.sin() * scale


class RotaryEmbedding(nn.Module):
    """Applies RoPE to queries and keys, looking cos/sin up by absolute position.

    The cos/sin cache is a float32, non-persistent buffer of shape
    ``[max_position_embeddings, rotary_dim // 2]``; it is cast to the query dtype on use,
    as transformers does. With LongRoPE it has ``original_max_position_embeddings`` more
    rows in front: the short factors' table (see :meth:`cache_rows`).
    """

    def __init__(self, head_dim: int, max_position_embeddings: int, rope: RopeParameters):
        super().__init__()
        rotary_dim = int(head_dim * rope.partial_rotary_factor)
        if rotary_dim % 2 != 0 or rotary_dim == 0:
            raise ConfigError(
                f"RoPE needs an even, non-zero number of rotated dimensions; head_dim="
                f"{head_dim} with partial_rotary_factor={rope.partial_rotary_factor} gives "
                f"{rotary_dim}"
            )
        self.head_dim = head_dim
        #: Dimensions rotated at the start of each head (``head_dim`` unless partial).
        self.rotary_dim = rotary_dim
        self.max_position_embeddings = max_position_embeddings
        #: LongRoPE's settings (``None``: one table for every sequence).
        self.longrope: LongRope | None = None
        if rope.rope_type == "longrope":
            self.longrope = LongRope.from_scaling(rope.scaling, rotary_dim, max_position_embeddings)
            cos, sin = self._longrope_tables(rope.rope_theta)
        else:
            cos, sin = cos_sin_tables(compute_inv_freq(rotary_dim, rope), max_position_embeddings)
        self.register_buffer("cos_cache", cos, persistent=False)
        self.register_buffer("sin_cache", sin, persistent=False)

    def _longrope_tables(self, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
        """``[original_max + max_position_embeddings, rotary_dim // 2]`` cos and sin: the
        short factors' rows for the positions a short sequence has, then the long ones'."""
        longrope = self.longrope
        short = cos_sin_tables(
            longrope.inv_freq(theta, long=False),
            longrope.original_max_position_embeddings,
            longrope.attention_factor,
        )
        long = cos_sin_tables(
            longrope.inv_freq(theta, long=True),
            self.max_position_embeddings,
            longrope.attention_factor,
        )
        return torch.cat((short[0], long[0])), torch.cat((short[1], long[1]))

    def limit_positions(self, num_positions: int) -> None:
        """Keep the tables' rows for positions ``0 .. num_positions - 1`` only (the engine's
        ``max_model_len``; the tables are built for ``max_position_embeddings``, e.g. 16 MiB
        each for Gemma 3's 32,768 positions of 128 frequencies). LongRoPE keeps its short
        table whole and cuts the long one."""
        rows = num_positions
        if self.longrope is not None:
            rows += self.longrope.original_max_position_embeddings
        if rows < self.cos_cache.shape[0]:
            self.cos_cache = self.cos_cache[:rows].clone()
            self.sin_cache = self.sin_cache[:rows].clone()

    @property
    def long_rope_threshold(self) -> int | None:
        """LongRoPE: a sequence of more known tokens than this is rotated with the long
        factors; ``None`` without LongRoPE."""
        return None if self.longrope is None else self.longrope.original_max_position_embeddings

    def cache_rows(
        self, positions: torch.Tensor, context_lens: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Rows of the cos/sin cache for ``positions`` ``[T]``: the positions themselves,
        but for LongRoPE: ``position + original_max`` for tokens rotated with the long
        factors.

        ``context_lens`` ``[T]``: how many tokens each token's sequence knew when its cache
        was started (``AttentionMetadata.context_lens_at_cache_start``); the long factors
        rotate the tokens of sequences of more than ``original_max`` (see
        :mod:`vlite.models.longrope`). Without it the step is taken as one sequence, long
        when its last position is at or past ``original_max``.
        """
        if self.longrope is None or positions.numel() == 0:
            return positions
        original_max = self.longrope.original_max_position_embeddings
        if context_lens is None:
            use_long = positions.max() >= original_max  # a 0-d tensor: no host sync
        else:
            use_long = context_lens > original_max
        return positions + use_long.to(positions.dtype) * original_max

    @classmethod
    def from_config(
        cls, config: Any, head_dim: int, layer_type: str = "full_attention"
    ) -> RotaryEmbedding:
        """Build from a Hugging Face config (either rope spelling, see module docstring), for
        the layers of ``layer_type`` (see :func:`rope_parameters_from_config`)."""
        rope = rope_parameters_from_config(config, layer_type)
        return cls(head_dim, config.max_position_embeddings, rope)

    def forward(
        self,
        positions: torch.Tensor,
        query: torch.Tensor,
        key: torch.Tensor,
        context_lens: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate ``query`` ``[T, num_heads, head_dim]`` and ``key`` ``[T, num_kv_heads,
        head_dim]`` by ``positions`` ``[T]``; returns new tensors of the same shapes.
        ``context_lens``: see :meth:`cache_rows`."""
        rotation = StepRotation(self, positions, query.dtype, context_lens=context_lens)
        return rotation.rotate(query), rotation.rotate(key)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x * cos + rotate_half(x) * sin`` on the first ``2 * cos.shape[-1]`` dimensions of
    ``x`` ``[T, heads, head_dim]``; the rest (partial rotary) pass through."""
    rotary_dim = 2 * cos.shape[-1]
    if rotary_dim != x.shape[-1]:
        rotated = _rotate(x[..., :rotary_dim], cos, sin)
        return torch.cat((rotated, x[..., rotary_dim:]), dim=-1)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class StepRotation:
    """The rotation for one step's positions, looked up once and applied by every layer.

    With ``native`` (:class:`~vlite.kernels.native.FusedOps`), float32 CPU tensors are
    rotated in place by one C call; otherwise cos/sin rows are gathered once here and each
    layer's :meth:`rotate` is the reference formula (HF's ``rotate_half``).
    ``context_lens`` ``[T]`` picks LongRoPE's table per token (see
    :meth:`RotaryEmbedding.cache_rows`).
    """

    def __init__(
        self,
        rope: RotaryEmbedding,
        positions: torch.Tensor,
        dtype: torch.dtype,
        native: Any = None,
        context_lens: torch.Tensor | None = None,
    ) -> None:
        self.head_dim = rope.head_dim
        rows = rope.cache_rows(positions, context_lens)
        is_native = (
            native is not None
            and native.handles(dtype, rows.device)
            and (rope.rotary_dim == rope.head_dim or native.rotates_partial_heads)
            and rope.cos_cache.dtype == torch.float32
        )
        self.native = native if is_native else None
        if self.native is not None:
            self.table_rows = rows.to(torch.int64).contiguous()
            self.cos_table, self.sin_table = rope.cos_cache, rope.sin_cache
        else:
            self.cos = rope.cos_cache[rows].to(dtype).unsqueeze(1)  # [T, 1, rotary_dim // 2]
            self.sin = rope.sin_cache[rows].to(dtype).unsqueeze(1)

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[T, heads, head_dim]`` rotated (a new tensor)."""
        if self.native is not None:  # a copy rotated in place by the C kernel
            rows = x.reshape(x.shape[0], -1).clone()
            self.native.rope_(
                rows, x.shape[1], self.head_dim, self.table_rows, self.cos_table, self.sin_table
            )
            return rows.view_as(x)
        return _rotate(x, self.cos, self.sin)

    def rotate_rows_(self, rows: torch.Tensor, num_heads: int) -> bool:
        """Rotate the first ``num_heads`` heads of each row of ``rows`` ``[T, W]`` in place.

        Returns ``False`` (and leaves ``rows`` alone) when the native path does not apply.
        """
        if self.native is None or rows.stride(-1) != 1:
            return False
        self.native.rope_(
            rows, num_heads, self.head_dim, self.table_rows, self.cos_table, self.sin_table
        )
        return True


def limit_rotary_positions(model: nn.Module, num_positions: int) -> None:
    """Cut every :class:`RotaryEmbedding` of ``model`` to ``num_positions`` positions (see
    :meth:`RotaryEmbedding.limit_positions`)."""
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.limit_positions(num_positions)
