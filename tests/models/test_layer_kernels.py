"""The Triton fused layer steps (RMSNorm with residual, RoPE in place, SwiGLU's activation)
against the PyTorch ops they replace, under the Triton interpreter on CPU tensors.

float16 is checked bit for bit (the interpreter rounds it as a GPU does; its bfloat16 is
emulated, so bfloat16 is left to ``pytest -m gpu``); float32 to a few units in the last
place (the sum of squares is added in another order).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vlite.core.attention import AttentionMetadata
from vlite.models.layer_kernels import load_fused_ops
from vlite.models.llama import LlamaForCausalLM, RMSNorm
from vlite.models.loader import build_model, load_hf_config
from vlite.models.rope import _rotate
from vlite.plugins.attention.torch_ref import TorchAttentionBackend
from vlite.testing.tiny_models import make_tiny_model

DTYPES = [torch.float32, torch.float16]


@pytest.fixture(scope="module")
def ops():
    return load_fused_ops("cpu")


def assert_matches(actual: torch.Tensor, expected: torch.Tensor) -> None:
    if actual.dtype == torch.float16:
        assert torch.equal(actual, expected)
    else:
        torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-6)


def _random(*shape, dtype, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [96, 80])  # a power of two's tile, and a masked one
def test_add_rmsnorm_matches_the_norm_and_updates_the_residual(ops, dtype, hidden):
    norm = RMSNorm(hidden, 1e-6).to(dtype)
    norm.weight.data = 1 + 0.1 * _random(hidden, dtype=dtype, seed=1)
    x, residual = _random(5, hidden, dtype=dtype), _random(5, hidden, dtype=dtype, seed=2)
    expected, expected_residual = norm(x, residual.clone())
    updated = residual.clone()
    assert_matches(ops.add_rmsnorm(x, updated, norm.weight, 1e-6), expected)
    assert torch.equal(updated, expected_residual)  # the sum, rounded as x + residual
    assert_matches(ops.add_rmsnorm(x, None, norm.weight, 1e-6), norm(x))


def test_add_rmsnorm_takes_per_head_rows_of_a_strided_view(ops):
    """Qwen3's q/k norms: ``[T, heads, head_dim]`` views of the fused projection."""
    qkv = _random(3, 4 * 16, dtype=torch.float16)
    q = qkv[:, : 3 * 16].view(3, 3, 16)
    norm = RMSNorm(16, 1e-6).to(torch.float16)
    out = ops.add_rmsnorm(q, None, norm.weight, 1e-6)
    assert out.shape == q.shape
    assert torch.equal(out, norm(q))


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul_matches_swiglu(ops, dtype):
    gate_up = _random(4, 2 * 40, dtype=dtype) * 3
    gate, up = gate_up.chunk(2, dim=-1)
    assert_matches(ops.silu_mul(gate_up), F.silu(gate) * up)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rotary_half", [8, 4])  # whole heads, and a partial rotary
def test_rope_rotates_the_leading_heads_of_each_row_in_place(ops, dtype, rotary_half):
    """Rows as the fused projection lays them out: 3 query heads, 1 key head, 1 value head;
    the first 4 heads turn, the value head stays, and so do the dimensions past the
    rotary ones."""
    num_tokens, head_dim = 4, 16
    rows = _random(num_tokens, 5 * head_dim, dtype=dtype)
    positions = torch.tensor([0, 3, 7, 2])
    cos = _random(10, rotary_half, dtype=torch.float32, seed=3)
    sin = _random(10, rotary_half, dtype=torch.float32, seed=4)
    qk = rows[:, : 4 * head_dim].view(num_tokens, 4, head_dim)
    expected = _rotate(qk, cos[positions].to(dtype)[:, None], sin[positions].to(dtype)[:, None])
    rotated = rows.clone()
    ops.rope_(rotated, 4, head_dim, positions, cos, sin)
    assert_matches(rotated[:, : 4 * head_dim].view_as(qk), expected)
    assert torch.equal(rotated[:, 4 * head_dim :], rows[:, 4 * head_dim :])


def test_handles_its_dtypes_on_its_device_only(ops):
    assert ops.handles(torch.bfloat16, torch.device("cpu"))  # interpreted: CPU tensors
    assert not ops.handles(torch.int64, torch.device("cpu"))
    assert not ops.handles(torch.float32, torch.device("meta"))


def _prefill_logits(model: LlamaForCausalLM, prompt: list[int]) -> torch.Tensor:
    """The logits of one prompt in one step (blocks 0..), fresh caches."""
    block_size, num_tokens = 16, len(prompt)
    num_blocks = -(-num_tokens // block_size)
    caches = [torch.zeros(model.attention.kv_cache_shape(num_blocks)) for _ in range(4)]
    caches = caches[: model.num_layers]
    metadata = AttentionMetadata(
        slot_mapping=torch.arange(num_tokens),
        query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32),
        seq_lens=torch.tensor([num_tokens], dtype=torch.int32),
        block_tables=torch.arange(num_blocks, dtype=torch.int32)[None],
        max_query_len=num_tokens,
        max_seq_len=num_tokens,
        query_lens_cpu=[num_tokens],
        seq_lens_cpu=[num_tokens],
    )
    with torch.no_grad():
        hidden = model(torch.tensor(prompt), torch.arange(num_tokens), caches, metadata)
        return model.compute_logits(hidden)


def float_model(folder, model_cls):
    """``model_cls`` over the tiny checkpoint in ``folder``: float32 on the CPU, the
    ``torch`` attention backend."""
    return build_model(
        load_hf_config(folder),
        model_cls,
        TorchAttentionBackend,
        block_size=16,
        dtype=torch.float32,
        device="cpu",
        load_format="safetensors",
        folder=folder,
    )


@pytest.mark.parametrize(
    "architecture,overrides",
    [
        ("LlamaForCausalLM", {}),
        ("Qwen3ForCausalLM", {}),  # per-head q/k norms, rotated out of place
        ("LlamaForCausalLM", {"partial_rotary_factor": 0.5}),
    ],
    ids=["llama", "qwen3-qk-norm", "partial-rotary"],
)
def test_a_model_using_the_fused_ops_computes_its_own_logits(
    ops, tmp_path, architecture, overrides
):
    model = float_model(make_tiny_model(tmp_path, architecture, **overrides), LlamaForCausalLM)
    prompt = list(range(5, 40))
    expected = _prefill_logits(model, prompt)
    counting = CountingOps(ops)
    model.use_fused_ops(counting)
    torch.testing.assert_close(_prefill_logits(model, prompt), expected, rtol=1e-4, atol=1e-4)
    # Every norm (the q/k norms too), every layer's activation and rotation ran fused.
    num_layers = model.num_layers
    per_layer_norms = 4 if architecture == "Qwen3ForCausalLM" else 2
    assert counting.calls["add_rmsnorm"] == per_layer_norms * num_layers + 1
    assert counting.calls["silu_mul"] == num_layers
    assert counting.calls["rope_"] >= num_layers


class MultipliedLlama(LlamaForCausalLM):
    """Llama with every multiplier hook away from 1 (Granite's kind of model)."""

    @classmethod
    def attention_scale(cls, hf_config):
        return 0.1

    @classmethod
    def embedding_multiplier(cls, hf_config):
        return 2.0

    @classmethod
    def residual_multiplier(cls, hf_config):
        return 0.5

    @classmethod
    def logits_scaling(cls, hf_config):
        return 4.0


@pytest.mark.parametrize("kernels", ["triton-interpreter", "c"])
def test_the_multiplier_hooks_compute_the_same_through_the_fused_ops(ops, tmp_path, kernels):
    """The residual multiplier scales each sublayer's output before the fused residual add
    (and the other hooks apply) exactly as in the PyTorch path."""
    from vlite.kernels.native import fused_ops

    folder = make_tiny_model(tmp_path, "LlamaForCausalLM")
    prompt = list(range(5, 40))
    model = float_model(folder, MultipliedLlama)
    expected = _prefill_logits(model, prompt)
    plain = _prefill_logits(float_model(folder, LlamaForCausalLM), prompt)
    assert (expected - plain).abs().max() > 0.1  # the hooks change the model
    counting = CountingOps(ops if kernels == "triton-interpreter" else fused_ops())
    model.use_fused_ops(counting)
    torch.testing.assert_close(_prefill_logits(model, prompt), expected, rtol=1e-4, atol=1e-4)
    assert counting.calls["add_rmsnorm"] == 2 * model.num_layers + 1


class CountingOps:
    """Forwards to ``ops``, counting the calls of each fused step."""

    def __init__(self, ops):
        self.ops = ops
        self.calls = {"add_rmsnorm": 0, "silu_mul": 0, "rope_": 0}
        self.rotates_partial_heads = ops.rotates_partial_heads
        self.norms_any_rank = ops.norms_any_rank
        self.handles = ops.handles

    def __getattr__(self, name):
        function = getattr(self.ops, name)

        def counted(*args, **kwargs):
            self.calls[name] += 1
            return function(*args, **kwargs)

        return counted


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_compiled_kernels_match_pytorch_on_cuda(dtype):
    """The compiled kernels on CUDA tensors: the residual sum bit for bit, the rest to the
    dtype's rounding."""
    ops = load_fused_ops("cuda")
    assert not ops.interpreted
    hidden, device = 2048, torch.device("cuda")
    norm = RMSNorm(hidden, 1e-5).to(device, dtype)
    norm.weight.data = 1 + 0.1 * _random(hidden, dtype=dtype, seed=1).to(device)
    x = _random(7, hidden, dtype=dtype).to(device)
    residual = _random(7, hidden, dtype=dtype, seed=2).to(device)
    expected, expected_residual = norm(x, residual.clone())
    updated = residual.clone()
    torch.testing.assert_close(ops.add_rmsnorm(x, updated, norm.weight, 1e-5), expected)
    assert torch.equal(updated, expected_residual)
    gate_up = _random(7, 2 * 8192, dtype=dtype).to(device)
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(ops.silu_mul(gate_up), F.silu(gate) * up)
    rows = _random(7, 48 * 64, dtype=dtype).to(device)  # 32 query, 8 key, 8 value heads
    positions = torch.tensor([0, 5, 9, 100, 3, 2, 1], device=device)
    cos = _random(128, 32, dtype=torch.float32, seed=3).to(device)
    sin = _random(128, 32, dtype=torch.float32, seed=4).to(device)
    qk = rows[:, : 40 * 64].view(7, 40, 64)
    expected = _rotate(qk, cos[positions].to(dtype)[:, None], sin[positions].to(dtype)[:, None])
    rotated = rows.clone()
    ops.rope_(rotated, 40, 64, positions, cos, sin)
    # Compiled, the kernel's ``x1 * cos - x2 * sin`` may be contracted to one fused
    # multiply-add, skipping the rounding of one product to the dtype: where the two
    # products cancel, the result then differs from PyTorch's by up to one rounding of a
    # product (seen on an H100 and an H200 in bfloat16 and float16; 1.5-2.8% of the values).
    x1, x2 = qk.float().chunk(2, dim=-1)
    c, s = (t[positions][:, None].to(dtype).float() for t in (cos, sin))
    one_rounding = torch.finfo(dtype).eps * (x1.abs() + x2.abs()) * (c.abs() + s.abs())
    error = (rotated[:, : 40 * 64].view_as(qk).float() - expected.float()).abs()
    assert (error <= torch.cat([one_rounding, one_rounding], dim=-1)).all()
