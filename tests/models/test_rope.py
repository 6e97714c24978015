"""RoPE parameters and inverse frequencies against transformers' own initialisers."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from vlite.models.rope import (
    RotaryEmbedding,
    compute_inv_freq,
    default_inv_freq,
    rope_parameters_from_config,
)

LLAMA3 = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 256,
}


def _config(**kw):
    return LlamaConfig(hidden_size=256, num_attention_heads=4, max_position_embeddings=1024, **kw)


def test_default_inv_freq_matches_transformers():
    config = _config(rope_parameters={"rope_type": "default", "rope_theta": 1234.0})
    expected, _ = LlamaRotaryEmbedding.compute_default_rope_parameters(config)
    rope = rope_parameters_from_config(config)
    assert rope.rope_theta == 1234.0
    torch.testing.assert_close(compute_inv_freq(64, rope), expected, rtol=0, atol=0)


def test_llama3_inv_freq_matches_transformers():
    config = _config(rope_parameters=dict(LLAMA3))
    expected, scaling = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    assert scaling == 1.0
    rope = rope_parameters_from_config(config)
    assert rope.rope_type == "llama3"
    inv_freq = compute_inv_freq(64, rope)
    torch.testing.assert_close(inv_freq, expected, rtol=1e-6, atol=0)
    # All three bands are present, so the test covers each branch of the scaling.
    unscaled = default_inv_freq(64, LLAMA3["rope_theta"])
    assert (inv_freq == unscaled).any() and (inv_freq == unscaled / 8).any()
    assert ((inv_freq < unscaled) & (inv_freq > unscaled / 8)).any()


def test_reads_transformers_4_style_attributes():
    legacy = SimpleNamespace(
        rope_theta=500000.0,
        rope_scaling={k: v for k, v in LLAMA3.items() if k != "rope_theta"},
    )
    rope = rope_parameters_from_config(legacy)
    assert rope.rope_theta == 500000.0
    assert rope.rope_type == "llama3"
    assert rope.scaling["factor"] == 8.0

    plain = rope_parameters_from_config(SimpleNamespace(rope_theta=1e6, rope_scaling=None))
    assert (plain.rope_theta, plain.rope_type) == (1e6, "default")


def test_unsupported_rope_type_is_an_error():
    rope = rope_parameters_from_config(
        _config(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0})
    )
    with pytest.raises(ValueError, match="yarn"):
        compute_inv_freq(64, rope)


def test_rotation_matches_rotate_half_formula():
    rotary = RotaryEmbedding.from_config(_config(rope_parameters=dict(LLAMA3)), 64)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(5, 4, 64, generator=gen)
    k = torch.randn(5, 2, 64, generator=gen)
    positions = torch.tensor([0, 1, 7, 300, 1023])
    q_out, k_out = rotary(positions, q, k)

    angles = positions[:, None].float() * compute_inv_freq(64, rotary_params())
    cos = torch.cat([angles.cos(), angles.cos()], -1)[:, None]
    sin = torch.cat([angles.sin(), angles.sin()], -1)[:, None]

    def rotate_half(x):
        return torch.cat([-x[..., 32:], x[..., :32]], -1)

    torch.testing.assert_close(q_out, q * cos + rotate_half(q) * sin)
    torch.testing.assert_close(k_out, k * cos + rotate_half(k) * sin)
    torch.testing.assert_close(q_out[0], q[0])  # position 0 is the identity


def rotary_params():
    return rope_parameters_from_config(_config(rope_parameters=dict(LLAMA3)))


def test_partial_rotary_rotates_the_leading_dimensions_and_passes_the_rest():
    config = _config(rope_parameters={"rope_theta": 1e4, "partial_rotary_factor": 0.5})
    rotary = RotaryEmbedding.from_config(config, 64)
    assert rotary.rotary_dim == 32 and rotary.cos_cache.shape[-1] == 16
    full = RotaryEmbedding.from_config(_config(rope_parameters={"rope_theta": 1e4}), 32)
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(4, 3, 64, generator=gen)
    k = torch.randn(4, 1, 64, generator=gen)
    positions = torch.tensor([0, 5, 9, 200])

    q_out, k_out = rotary(positions, q, k)
    q_lead, k_lead = full(positions, q[..., :32].contiguous(), k[..., :32].contiguous())

    torch.testing.assert_close(q_out[..., :32], q_lead)  # as a 32-dim head with its own freqs
    torch.testing.assert_close(k_out[..., :32], k_lead)
    assert torch.equal(q_out[..., 32:], q[..., 32:]) and torch.equal(k_out[..., 32:], k[..., 32:])


def test_a_partial_factor_leaving_an_odd_or_empty_rotation_is_refused():
    for factor in (0.03, 0.5):
        config = _config(rope_parameters={"rope_theta": 1e4, "partial_rotary_factor": factor})
        with pytest.raises(ValueError, match="even, non-zero"):
            RotaryEmbedding.from_config(config, 6 if factor == 0.5 else 16)


def test_limiting_positions_keeps_the_rows_a_context_reaches():
    rotary = RotaryEmbedding.from_config(_config(rope_parameters={"rope_theta": 1e4}), 32)
    full_cos, full_sin = rotary.cos_cache.clone(), rotary.sin_cache.clone()
    rotary.limit_positions(100)
    assert rotary.cos_cache.shape == (100, 16)
    assert torch.equal(rotary.cos_cache, full_cos[:100])
    assert torch.equal(rotary.sin_cache, full_sin[:100])
    rotary.limit_positions(4096)  # more than the table has: unchanged
    assert rotary.cos_cache.shape == (100, 16)


def test_the_engine_holds_rotary_rows_for_its_context_only(tmp_path):
    from vlite import LLM
    from vlite.testing.tiny_models import make_tiny_model

    folder = make_tiny_model(tmp_path, "LlamaForCausalLM")  # 512 positions
    llm = LLM(model=str(folder), max_model_len=96, num_kv_blocks=8)
    model = llm.llm_engine.engine_core.executor.worker.runner.model
    tables = [m.cos_cache.shape[0] for m in model.modules() if isinstance(m, RotaryEmbedding)]
    assert tables == [96]


def test_the_tables_keep_only_the_positions_the_kv_cache_holds(tmp_path):
    from vlite import LLM, SamplingParams
    from vlite.testing.tiny_models import make_tiny_model

    folder = make_tiny_model(tmp_path, "LlamaForCausalLM")  # 512 positions
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompt = {"prompt_token_ids": list(range(3, 50))}  # 47 + 12 tokens: 4 blocks of 16
    small = LLM(model=str(folder), max_model_len=96, num_kv_blocks=4)
    model = small.llm_engine.engine_core.executor.worker.runner.model
    tables = [m.cos_cache.shape[0] for m in model.modules() if isinstance(m, RotaryEmbedding)]
    assert tables == [64]  # 4 blocks x 16 tokens, fewer than max_model_len
    tokens = small.generate([prompt], params)[0].outputs[0].token_ids
    large = LLM(model=str(folder), max_model_len=96, num_kv_blocks=16)
    assert large.generate([prompt], params)[0].outputs[0].token_ids == tokens
