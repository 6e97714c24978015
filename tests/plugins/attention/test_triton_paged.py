"""The ``triton`` backend: registration, limits, the interpreter switch, GPU-only checks.

The kernels' numerics are in test_triton_kernels.py; the conformance suite runs on this
backend from tests/testing/test_builtin_conformance.py.
"""

from __future__ import annotations

import importlib.util
import os
import random
import subprocess
import sys
import textwrap

import pytest
import torch

from vlite import LLM
from vlite.plugins.attention.triton_paged import (
    TritonAttentionBackend,
    register_attention_backends,
)
from vlite.testing.attention_cases import AttentionShape, random_batch, run_case

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_registers_as_triton():
    registered = {}
    register_attention_backends(lambda name, cls: registered.__setitem__(name, cls))
    assert registered == {"triton": TritonAttentionBackend}


def test_declares_its_limits():
    assert {64, 128, 16, 256} <= set(TritonAttentionBackend.supported_head_dims)
    assert 8 not in TritonAttentionBackend.supported_head_dims
    assert TritonAttentionBackend.supported_block_sizes == (16, 32, 64, 128, 256)
    assert set(TritonAttentionBackend.supported_dtypes) == {
        torch.float32,
        torch.bfloat16,
        torch.float16,
    }


def test_unavailable_without_the_triton_package(monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "triton" else find_spec(name)
    )
    reason = TritonAttentionBackend.unavailable_reason(torch.device("cpu"), torch.float32)
    assert "pip install triton" in reason


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"block_size": 8}, "does not support block size 8; it supports: 16, 32"),
        ({"head_dim": 8}, "does not support head dim 8; it supports: 16, 32"),
    ],
)
def test_engine_construction_checks_the_limits(tmp_path, overrides, message):
    from vlite.testing.tiny_models import make_tiny_model

    head_dim = overrides.get("head_dim", 16)
    folder = make_tiny_model(tmp_path, "LlamaForCausalLM", hidden_size=4 * head_dim)
    with pytest.raises(ValueError, match=message):
        LLM(
            model=str(folder),
            attention_backend="triton",
            block_size=overrides.get("block_size", 16),
            num_kv_blocks=8,
        )


# ---- the interpreter switch, in fresh processes ------------------------------------------

CHECK_INTERPRETER = textwrap.dedent(
    """
    import os, sys, warnings
    if sys.argv[1] == "triton-first":
        import triton  # before vlite could set TRITON_INTERPRET=1
    import torch
    from vlite.core.plugins import PluginRegistry, build_plugin_manager
    from vlite.plugins.attention.auto import resolve_attention_backend
    registry = PluginRegistry(build_plugin_manager())
    # What the engine does first: pick the backend and check that it can run.
    _, cls = resolve_attention_backend("triton", torch.device("cpu"), torch.float32, registry)
    # Loading vlite and its plugins changes nothing for other Triton users.
    assert "TRITON_INTERPRET" not in os.environ
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        backend = cls(4, 2, 64, 0.125, 16)
        cls(4, 2, 64, 0.125, 16)  # a second backend warns no more
    assert os.environ["TRITON_INTERPRET"] == "1"
    assert backend.kernels_for(torch.device("cpu")).interpreted
    messages = [str(w.message) for w in caught if "Triton interpreter" in str(w.message)]
    assert len(messages) == 1, messages
    assert "\\n" not in messages[0] and "not speed" in messages[0]
    print("MENTIONS-EARLY-IMPORT" if "already imported" in messages[0] else "QUIET")
    from vlite.testing.attention_cases import AttentionShape, boundary_batch, run_case
    shape = AttentionShape(64, 2, 16)
    for r in run_case(backend, shape, boundary_batch(16)[:4]):
        torch.testing.assert_close(r.output.double(), r.expected, atol=1e-4, rtol=1e-4)
    print("OK")
    """
)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only path")
@pytest.mark.parametrize("order", ["vlite-first", "triton-first"])
def test_without_cuda_the_backend_switches_to_the_interpreter_itself(order):
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    completed = subprocess.run(
        [sys.executable, "-c", CHECK_INTERPRETER, order],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    lines = completed.stdout.split()
    assert lines[-1] == "OK"
    expected = "MENTIONS-EARLY-IMPORT" if order == "triton-first" else "QUIET"
    assert lines[-2] == expected


CHECK_PRIVATE_COPY = textwrap.dedent(
    """
    import os, warnings
    import torch
    # As in a GPU process: CUDA is "present", so TRITON_INTERPRET must not be set for all.
    torch.cuda.is_available = lambda: True
    from vlite.plugins.attention.triton_kernels import load_kernels, paged_attention
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        kernels = load_kernels("cpu")
    assert kernels.interpreted and "interpreted copy" in str(caught[0].message)
    assert "TRITON_INTERPRET" not in os.environ  # restored
    assert not paged_attention.is_interpreted()  # the process's own kernels stay compiled
    from vlite.plugins.attention.triton_paged import TritonAttentionBackend
    from vlite.testing.attention_cases import AttentionShape, run_case
    shape = AttentionShape(64, 2, 16)
    backend = TritonAttentionBackend(4, 2, 64, shape.scale, 16)
    assert backend.kernels_for(torch.device("cpu")) is kernels
    for r in run_case(backend, shape, [(0, 17), (20, 1), (16, 3)]):
        torch.testing.assert_close(r.output.double(), r.expected, atol=1e-4, rtol=1e-4)
    print("OK")
    """
)


@pytest.mark.skipif(torch.cuda.is_available(), reason="simulates CUDA on a CPU-only machine")
def test_cpu_tensors_in_a_cuda_process_use_a_private_interpreted_copy():
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    completed = subprocess.run(
        [sys.executable, "-c", CHECK_PRIVATE_COPY],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    assert completed.stdout.split()[-1] == "OK"


# ---- on a GPU --------------------------------------------------------------------------

GPU_SHAPES = [AttentionShape(128, 4, 16, num_kv_heads=8), AttentionShape(64, 1, 32)]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=str)
@pytest.mark.parametrize("num_splits", [None, 4])
def test_cuda_larger_batches_match_dense_attention(shape, dtype, num_splits):
    tol = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 1e-2}[dtype]
    backend = TritonAttentionBackend(
        shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.scale, shape.block_size
    )
    backend.num_splits = num_splits
    rng = random.Random(0)
    # Long contexts (several hundred tokens) and more sequences than the CPU tests afford.
    batch = [(rng.randint(0, 600), rng.choice([1, 1, 1, 37, 300])) for _ in range(24)]
    for result in run_case(backend, shape, batch, dtype, seed=1, device="cuda"):
        torch.testing.assert_close(result.output.double(), result.expected, atol=tol, rtol=tol)


@pytest.mark.gpu
@needs_cuda
def test_cuda_random_batches_with_the_split_heuristic():
    shape = AttentionShape(128, 4, 16, num_kv_heads=8)
    backend = TritonAttentionBackend(
        shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.scale, shape.block_size
    )
    rng = random.Random(1)
    for seed in range(3):
        batch = random_batch(rng, shape.block_size)
        for result in run_case(backend, shape, batch, torch.bfloat16, seed, "cuda"):
            torch.testing.assert_close(
                result.output.double(), result.expected, atol=3e-2, rtol=3e-2
            )


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("num_splits", [None, 4])
@pytest.mark.parametrize("soft_cap", [None, 1.0])
def test_cuda_sliding_window_matches_dense_attention(dtype, num_splits, soft_cap):
    tol = {torch.float32: 1e-4, torch.bfloat16: 3e-2}[dtype]
    shape = AttentionShape(128, 4, 16, num_kv_heads=8)
    backend = TritonAttentionBackend(
        shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.scale, shape.block_size
    )
    backend.num_splits = num_splits
    rng = random.Random(2)
    batch = [(rng.randint(0, 600), rng.choice([1, 1, 1, 37, 300])) for _ in range(24)]
    for window in (7, 64, 250):
        results = run_case(backend, shape, batch, dtype, 3, "cuda", window, soft_cap)
        for result in results:
            torch.testing.assert_close(result.output.double(), result.expected, atol=tol, rtol=tol)
