"""The fused C kernels of the quantized CPU path against the PyTorch formulas they replace."""

from __future__ import annotations

import pytest
import torch

from vlite.kernels.native import fused_ops
from vlite.models.llama import RMSNorm
from vlite.models.rope import RopeParameters, RotaryEmbedding, StepRotation


def _norm(hidden: int) -> RMSNorm:
    norm = RMSNorm(hidden, 1e-5)
    norm.weight.data = torch.randn(hidden, generator=torch.Generator().manual_seed(0))
    return norm


def test_add_rmsnorm_matches_the_reference_and_updates_the_residual():
    x, residual = torch.randn(5, 96), torch.randn(5, 96)
    reference = _norm(96)
    expected, expected_residual = reference(x, residual.clone())
    native = _norm(96)
    native.native = fused_ops()
    out, new_residual = native(x, residual)
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
    assert new_residual is residual  # in place
    torch.testing.assert_close(residual, expected_residual)
    torch.testing.assert_close(native(x), reference(x), rtol=1e-6, atol=1e-6)


def test_rope_in_place_matches_rotate_half():
    rope = RotaryEmbedding(32, 128, RopeParameters(10000.0, "default", {}))
    positions = torch.tensor([0, 5, 77, 127])
    qkv = torch.randn(4, 6 * 32)  # 4 query + 1 key heads rotated, 1 value head left alone
    expected = StepRotation(rope, positions, torch.float32).rotate(qkv[:, :160].view(4, 5, 32))
    native = StepRotation(rope, positions, torch.float32, fused_ops())
    value = qkv[:, 160:].clone()
    assert native.rotate_rows_(qkv, 5)
    torch.testing.assert_close(qkv[:, :160].view(4, 5, 32), expected, rtol=1e-6, atol=1e-6)
    assert torch.equal(qkv[:, 160:], value)


def test_rope_without_native_ops_leaves_the_rows_alone():
    rope = RotaryEmbedding(32, 16, RopeParameters(10000.0, "default", {}))
    rows = torch.randn(2, 64)
    before = rows.clone()
    assert not StepRotation(rope, torch.tensor([1, 2]), torch.float32).rotate_rows_(rows, 2)
    assert torch.equal(rows, before)


def test_silu_mul_matches_the_swiglu_formula():
    gate_up = torch.randn(3, 2 * 40) * 6  # large gates too: silu's tails
    gate, up = gate_up.chunk(2, dim=-1)
    expected = torch.nn.functional.silu(gate) * up
    torch.testing.assert_close(fused_ops().silu_mul(gate_up), expected, rtol=1e-6, atol=1e-6)


def test_silu_mul_at_the_exponentials_limits():
    # e^-g overflows past g = -88.72 (silu is -0 there) and vanishes past g = 87: the vector
    # path's polynomial must give what expf gives, zeros and signs included.
    gate = torch.tensor([0.0, -0.0, 88.7, -88.7, 200.0, -200.0, 1e-30, -1e-30])
    gate = torch.cat([gate, torch.tensor([87.5, -87.5, 88.73, -88.73, 50.0, -50.0, 10.0, -10.0])])
    gate_up = torch.cat([gate, torch.full_like(gate, 3.0)])[None]
    expected = torch.nn.functional.silu(gate) * 3.0
    got = fused_ops().silu_mul(gate_up)[0]
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=0)
    assert torch.equal(torch.signbit(got), torch.signbit(expected))


def test_silu_mul_refuses_a_gate_up_it_cannot_split():
    with pytest.raises(ValueError, match=r"\[T, 2 \* I\]"):
        fused_ops().silu_mul(torch.randn(3, 7))
    with pytest.raises(TypeError, match="float32"):
        fused_ops().silu_mul(torch.randn(3, 8, dtype=torch.float64))


def test_gelu_tanh_mul_matches_the_geglu_formula_tails_included():
    gate = torch.cat([torch.randn(37) * 4, torch.tensor([0.0, -0.0, 1e-30, 30.0, -30.0, 200.0])])
    gate = torch.cat([gate, torch.tensor([-200.0, 9.0, -9.0, 1e-3, -1e-3])])  # 48: 6 vectors
    up = torch.randn(48)
    got = fused_ops().gelu_tanh_mul(torch.cat([gate, up])[None])[0]
    # Against the same function in float64, as g * sigmoid(2u) (PyTorch's 0.5 g (1 + tanh u)
    # loses relative precision where 1 + tanh cancels, even in float64).
    g = gate.double()
    exact = g * torch.sigmoid(2 * 0.7978845608028654 * (g + 0.044715 * g**3)) * up.double()
    torch.testing.assert_close(got.double(), exact, rtol=1e-5, atol=1e-37)
    float32 = torch.nn.functional.gelu(gate, approximate="tanh") * up
    torch.testing.assert_close(got, float32, rtol=1e-6, atol=1e-6)


def test_rmsnorm_heads_norms_each_head_of_strided_rows_in_place():
    from vlite.models.gemma import GemmaRMSNorm

    norm = GemmaRMSNorm(16, 1e-6)
    norm.weight.data = torch.randn(16, generator=torch.Generator().manual_seed(1))
    qkv = torch.randn(3, 5 * 16)  # 3 heads normed, 2 left alone
    expected = norm(qkv[:, :48].reshape(3, 3, 16)).reshape(3, 48)
    rest = qkv[:, 48:].clone()
    norm.use_fused(fused_ops())
    fused_ops().rmsnorm_heads_(qkv, 3, 16, norm.fused_weight, norm.eps)
    torch.testing.assert_close(qkv[:, :48], expected, rtol=1e-6, atol=1e-6)
    assert torch.equal(qkv[:, 48:], rest)
    with pytest.raises(ValueError, match="6 heads of 16"):
        fused_ops().rmsnorm_heads_(qkv, 6, 16, norm.fused_weight, norm.eps)


def test_scale_multiplies_in_place_as_pytorch_does():
    x = torch.randn(4, 24)
    expected = x * torch.tensor(640**0.5, dtype=torch.float32)
    fused_ops().scale_(x, 640**0.5)
    assert torch.equal(x, expected)
