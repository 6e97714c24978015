"""Shared fixtures for the engine (front-end) tests."""

from __future__ import annotations

from typing import Any

import pytest

from vlite.testing.tiny_models import make_tiny_tokenizer


@pytest.fixture(scope="session")
def tokenizer() -> Any:
    """The deterministic tiny byte-level BPE tokenizer (trained once per session)."""
    return make_tiny_tokenizer()


@pytest.fixture(scope="session")
def encode(tokenizer):
    """Text -> token ids, without the BOS token."""
    return lambda text: tokenizer.encode(text, add_special_tokens=False)
