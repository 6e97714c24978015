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
