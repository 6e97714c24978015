"""Fixtures shared by every test directory."""

from __future__ import annotations

import pytest
import torch

#: torch's switches for TF32 matrix products: (module, attribute).
TF32_SWITCHES = (
    (torch.backends.cuda.matmul, "allow_tf32"),
    (torch.backends.cudnn, "allow_tf32"),
)


@pytest.fixture
def exact_float32_products():
    """TF32 off for the test (exact float32 products on a GPU, as the CPU computes them).

    torch's backend flags live on objects with their own ``__getattr__``/``__setattr__``
    that cannot delete an attribute, so ``monkeypatch.setattr`` (which may restore by
    ``delattr``) must not touch them: this saves each value and sets it back itself.
    """
    saved = [(module, name, getattr(module, name)) for module, name in TF32_SWITCHES]
    try:
        for module, name, _ in saved:
            setattr(module, name, False)
        yield
    finally:
        for module, name, value in saved:
            setattr(module, name, value)


@pytest.fixture
def replayed_decode_sizes():
    """``replayed_decode_sizes(*qtypes) -> (1, ..., largest)``: the decode batch sizes the
    worker records for CPU step replay in a model whose products are of ``qtypes``, with
    int16 activations (the default): every size up to ``CPU_REPLAY_MAX_SEQS`` whose
    products stay in the C kernels on this CPU (an AVX2 build multiplies 32 rows of the
    32-value types by PyTorch's GEMM, which a recording refuses)."""
    from vlite.kernels.native import gguf_block_kernels
    from vlite.worker.worker import CPU_REPLAY_MAX_SEQS

    def sizes(*qtypes: str) -> tuple[int, ...]:
        kernels = gguf_block_kernels()
        panels = min(kernels.panel_rows(qtype, "int16") for qtype in qtypes)
        return tuple(range(1, min(CPU_REPLAY_MAX_SEQS, panels - 1) + 1))

    return sizes
