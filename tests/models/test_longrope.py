"""LongRoPE: the settings read from either config spelling, and vlite's short and long
cos/sin tables against transformers' Phi-3 rotary embedding, bit for bit."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from transformers import Phi3Config
from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding

from vlite.models.longrope import LongRope
from vlite.models.rope import RotaryEmbedding, rope_parameters_from_config

ORIGINAL_MAX = 32
MAX_POSITIONS = 128
HEAD_DIM = 16


def _factors(count: int, low: float, spread: float, seed: int) -> list[float]:
    values = torch.rand(count, generator=torch.Generator().manual_seed(seed))
    return [round(low + spread * float(v), 4) for v in values]


def _phi3_config(partial: float = 1.0, **extra) -> Phi3Config:
    pairs = int(HEAD_DIM * partial) // 2
    rope = {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "partial_rotary_factor": partial,
        "short_factor": _factors(pairs, 1.0, 1.0, seed=0),
        "long_factor": _factors(pairs, 2.0, 6.0, seed=1),
        **extra,
    }
    return Phi3Config(
        hidden_size=4 * HEAD_DIM,
        num_attention_heads=4,
        max_position_embeddings=MAX_POSITIONS,
        original_max_position_embeddings=ORIGINAL_MAX,
        rope_parameters=rope,
    )


def _hf_cos_sin(config: Phi3Config, num_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' ``[num_positions, rotary_dim // 2]`` cos and sin for one sequence of
    ``num_positions`` tokens (its halves repeat)."""
    rotary = Phi3RotaryEmbedding(config)
    positions = torch.arange(num_positions)[None]
    cos, sin = rotary(torch.zeros(1, dtype=torch.float32), positions)
    half = cos.shape[-1] // 2
    return cos[0, :, :half], sin[0, :, :half]


@pytest.mark.parametrize(
    "partial, extra",
    [
        (1.0, {}),  # Phi-3-mini-128k / Phi-3.5: attention factor from max / original max
        (0.75, {}),  # Phi-4-mini: a quarter of each head is not rotated
        (0.5, {"attention_factor": 1.25}),
        (1.0, {"factor": 3.0}),
    ],
)
def test_short_and_long_tables_equal_transformers(partial, extra):
    config = _phi3_config(partial, **extra)
    ours = RotaryEmbedding.from_config(config, HEAD_DIM)
    assert ours.long_rope_threshold == ORIGINAL_MAX
    for num_positions in (ORIGINAL_MAX, MAX_POSITIONS):  # short, then long
        positions = torch.arange(num_positions)
        rows = ours.cache_rows(positions)  # one sequence: its length picks the table
        hf_cos, hf_sin = _hf_cos_sin(config, num_positions)
        assert torch.equal(ours.cos_cache[rows], hf_cos)
        assert torch.equal(ours.sin_cache[rows], hf_sin)


def test_each_tokens_context_length_picks_the_table():
    ours = RotaryEmbedding.from_config(_phi3_config(), HEAD_DIM)
    positions = torch.tensor([3, 3, 40, 5])
    context_lens = torch.tensor([ORIGINAL_MAX, ORIGINAL_MAX + 1, 41, 6])
    rows = ours.cache_rows(positions, context_lens)
    assert rows.tolist() == [3, 3 + ORIGINAL_MAX, 40 + ORIGINAL_MAX, 5]
    assert not torch.equal(ours.cos_cache[rows[0]], ours.cos_cache[rows[1]])


def test_attention_factor_defaults_to_the_context_extension():
    rope = RotaryEmbedding.from_config(_phi3_config(), HEAD_DIM).longrope
    extension = MAX_POSITIONS / ORIGINAL_MAX
    assert rope.attention_factor == math.sqrt(1 + math.log(extension) / math.log(ORIGINAL_MAX))
    assert rope.uses_long_factors(ORIGINAL_MAX + 1) and not rope.uses_long_factors(ORIGINAL_MAX)


def test_reads_the_transformers_4_spelling():
    """``rope_scaling`` holds the factors; ``original_max_position_embeddings`` is on the config."""
    short, long = _factors(6, 1.0, 1.0, seed=2), _factors(6, 2.0, 6.0, seed=3)
    legacy = SimpleNamespace(
        rope_theta=10000.0,
        rope_scaling={"type": "longrope", "short_factor": short, "long_factor": long},
        partial_rotary_factor=0.75,
        max_position_embeddings=MAX_POSITIONS,
        original_max_position_embeddings=ORIGINAL_MAX,
    )
    params = rope_parameters_from_config(legacy)
    assert params.rope_type == "longrope" and params.partial_rotary_factor == 0.75
    assert params.scaling["original_max_position_embeddings"] == ORIGINAL_MAX
    rotary = RotaryEmbedding.from_config(legacy, HEAD_DIM)
    assert rotary.longrope.short_factor == tuple(short)
    assert rotary.cos_cache.shape == (ORIGINAL_MAX + MAX_POSITIONS, 6)
    # The same settings in transformers 5's spelling give the same tables.
    modern = _phi3_config(0.75)
    modern.rope_parameters.update(short_factor=short, long_factor=long)
    assert torch.equal(RotaryEmbedding.from_config(modern, HEAD_DIM).cos_cache, rotary.cos_cache)


@pytest.mark.parametrize("key", ["short_factor", "long_factor"])
def test_a_factor_list_of_the_wrong_length_is_refused_naming_the_lengths(key):
    scaling = {"short_factor": [1.0] * 4, "long_factor": [2.0] * 4}
    scaling[key] = [1.0] * 3
    scaling["original_max_position_embeddings"] = ORIGINAL_MAX
    with pytest.raises(ValueError, match=rf"{key} has 3 entries; it needs rotary_dim // 2 = 4"):
        LongRope.from_scaling(scaling, rotary_dim=8, max_position_embeddings=MAX_POSITIONS)


def test_missing_factors_are_refused_naming_them():
    with pytest.raises(ValueError, match="long_factor"):
        LongRope.from_scaling(
            {"short_factor": [1.0] * 4, "original_max_position_embeddings": 8}, 8, 16
        )
