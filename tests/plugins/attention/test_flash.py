"""The ``flash`` backend: PyTorch's flash SDPA kernel on CPU, flash-attn's varlen on CUDA.

The CUDA glue (cumulative key lengths, the paged call for 256-token blocks, the gathered
call for smaller ones) is checked on CPU against a stand-in ``flash_attn`` module that
implements flash-attn's documented varlen semantics densely; the real package runs in the
GPU-marked test.
"""

from __future__ import annotations

import random
import sys
import types

import pytest
import torch
from torch.profiler import profile

from vlite.plugins.attention import flash
from vlite.plugins.attention.auto import resolve_attention_backend
from vlite.plugins.attention.flash import FlashAttentionBackend, register_attention_backends
from vlite.testing.attention_cases import (
    AttentionShape,
    boundary_batch,
    build_metadata,
    dense_causal_attention,
    random_batch,
    run_case,
)

CUDA = torch.device("cuda")
CPU = torch.device("cpu")


def make_backend(shape: AttentionShape) -> FlashAttentionBackend:
    return FlashAttentionBackend(
        shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.scale, shape.block_size
    )


def check(backend, shape, batch, dtype=torch.float32, tol=1e-4, device="cpu"):
    for result in run_case(backend, shape, batch, dtype, seed=0, device=device):
        torch.testing.assert_close(result.output.double(), result.expected, atol=tol, rtol=tol)


def test_registers_as_flash():
    registered = {}
    register_attention_backends(lambda name, cls: registered.__setitem__(name, cls))
    assert registered == {"flash": FlashAttentionBackend}


# ---- CPU: PyTorch's flash SDPA kernel ------------------------------------------------------


@pytest.mark.parametrize("shape", [AttentionShape(64, 1, 16), AttentionShape(128, 4, 32)], ids=str)
def test_cpu_matches_dense_attention(shape):
    rng = random.Random(str(shape))
    check(make_backend(shape), shape, boundary_batch(shape.block_size))
    check(make_backend(shape), shape, random_batch(rng, shape.block_size))


@pytest.mark.parametrize("dtype, tol", [(torch.bfloat16, 3e-2), (torch.float16, 1e-2)], ids=str)
def test_cpu_low_precision(dtype, tol):
    shape = AttentionShape(64, 2, 16)
    check(make_backend(shape), shape, boundary_batch(16), dtype, tol)


def test_cpu_runs_every_attention_on_the_flash_kernel():
    shape = AttentionShape(64, 2, 16)
    with profile() as prof:
        run_case(make_backend(shape), shape, [(0, 20), (17, 1), (16, 5)])
    names = [event.name for event in prof.events()]
    num_sdpa = names.count("aten::scaled_dot_product_attention")
    assert num_sdpa > 0
    assert names.count("aten::_scaled_dot_product_flash_attention_for_cpu") == num_sdpa
    assert not any("math" in name for name in names if "attention" in name)


# ---- when it cannot run ----------------------------------------------------------------


def test_cuda_without_flash_attn_says_what_to_install(monkeypatch):
    monkeypatch.setattr(flash, "flash_attn_import_error", lambda: "not installed")
    reason = FlashAttentionBackend.unavailable_reason(CUDA, torch.bfloat16)
    assert "pip install flash-attn" in reason and "--attn triton" in reason


def test_cuda_float32_is_refused(monkeypatch):
    monkeypatch.setattr(flash, "flash_attn_import_error", lambda: None)
    assert FlashAttentionBackend.unavailable_reason(CUDA, torch.bfloat16) is None
    reason = FlashAttentionBackend.unavailable_reason(CUDA, torch.float32)
    assert "float16/bfloat16" in reason and "--dtype bfloat16" in reason


def test_cpu_without_the_flash_sdpa_kernel_fails_at_selection(monkeypatch):
    monkeypatch.setattr(flash, "cpu_flash_sdpa_error", lambda: "PyTorch 2.0 has none")
    with pytest.raises(RuntimeError, match="PyTorch 2.0 has none; upgrade PyTorch"):
        FlashAttentionBackend(4, 2, 64, 0.125, 16)
    from vlite.core.plugins import PluginRegistry, build_plugin_manager

    registry = PluginRegistry(build_plugin_manager(load_entry_points=False))
    with pytest.raises(ValueError, match="'flash' cannot run on cpu in float32: PyTorch 2.0"):
        resolve_attention_backend("flash", CPU, torch.float32, registry)


def test_this_pytorch_has_the_cpu_kernel():
    assert flash.cpu_flash_sdpa_error() is None


# ---- the CUDA path's glue, against a stand-in flash_attn ----------------------------------


def _varlen_reference(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    softmax_scale,
    causal,
    block_table=None,
    window_size=(-1, -1),
):
    """flash-attn's ``flash_attn_varlen_func`` semantics, densely: with ``block_table``,
    ``k``/``v`` are paged ``[num_blocks, page, heads, dim]``; causal is bottom-right; a
    ``window_size`` ``(left, 0)`` lets query ``p`` see keys ``p - left .. p``."""
    assert causal and q.dtype == k.dtype
    left, right = window_size
    assert right in (-1, 0)
    window = None if left < 0 else left + 1
    outputs = []
    for i in range(len(cu_seqlens_q) - 1):
        q_i = q[cu_seqlens_q[i] : cu_seqlens_q[i + 1]]
        seq_len = int(cu_seqlens_k[i + 1] - cu_seqlens_k[i])
        assert q_i.shape[0] <= max_seqlen_q and seq_len <= max_seqlen_k
        if block_table is None:
            k_i = k[cu_seqlens_k[i] : cu_seqlens_k[i + 1]]
            v_i = v[cu_seqlens_k[i] : cu_seqlens_k[i + 1]]
        else:
            page = k.shape[1]
            blocks = block_table[i, : -(-seq_len // page)].long()
            k_i = k[blocks].flatten(0, 1)[:seq_len]
            v_i = v[blocks].flatten(0, 1)[:seq_len]
        outputs.append(dense_causal_attention(q_i, k_i, v_i, softmax_scale, window).to(q.dtype))
    return torch.cat(outputs)


@pytest.fixture
def fake_flash_attn(monkeypatch):
    calls = []

    def flash_attn_varlen_func(*args, **kwargs):
        calls.append("paged" if kwargs.get("block_table") is not None else "gathered")
        return _varlen_reference(*args, **kwargs)

    module = types.ModuleType("flash_attn")
    module.flash_attn_varlen_func = flash_attn_varlen_func
    monkeypatch.setitem(sys.modules, "flash_attn", module)
    return calls


@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("block_size, path", [(16, "gathered"), (256, "paged")])
def test_cuda_glue_matches_dense_attention(fake_flash_attn, block_size, path, window):
    shape = AttentionShape(64, 2, block_size)
    backend = make_backend(shape)
    gen = torch.Generator().manual_seed(0)
    spans = [(0, 9), (300, 1), (37, 20), (5, 1)]  # (cached, new) per sequence
    seq_lens = [cached + new for cached, new in spans]
    num_blocks = [-(-n // block_size) for n in seq_lens]
    pool = torch.randperm(sum(num_blocks) + 2, generator=gen).tolist()
    tables = [[pool.pop() for _ in range(n)] for n in num_blocks]
    metadata = build_metadata(tables, spans, block_size, CPU)
    cache = torch.randn(backend.kv_cache_shape(sum(num_blocks) + 2), generator=gen)
    query = torch.randn(sum(new for _, new in spans), shape.num_heads, 64, generator=gen)

    out = backend._flash_attn_varlen(query, cache, metadata, window)

    assert fake_flash_attn == [path]
    flat = cache.view(2, -1, shape.num_kv_heads, 64)
    expected, start = [], 0
    for table, (cached, new) in zip(tables, spans):
        positions = torch.arange(cached + new)
        slots = torch.tensor(table)[positions // block_size] * block_size + positions % block_size
        q = query[start : start + new]
        keys, values = flat[0, slots], flat[1, slots]
        expected.append(dense_causal_attention(q, keys, values, shape.scale, window))
        start += new
    torch.testing.assert_close(out.double(), torch.cat(expected), atol=1e-5, rtol=1e-5)


# ---- on a GPU with flash-attn ----------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or flash.flash_attn_import_error() is not None,
    reason="needs a CUDA device and the flash-attn package",
)
@pytest.mark.parametrize("dtype, tol", [(torch.bfloat16, 3e-2), (torch.float16, 1e-2)], ids=str)
@pytest.mark.parametrize("block_size", [16, 256])
def test_cuda_flash_attn_matches_dense_attention(dtype, tol, block_size):
    shape = AttentionShape(128, 4, block_size, num_kv_heads=8)
    with torch.device("cuda"):
        backend = make_backend(shape)
    rng = random.Random(0)
    batch = [(rng.randint(0, 700), rng.choice([1, 1, 29, 300])) for _ in range(16)]
    check(backend, shape, batch, dtype, tol, device="cuda")
