"""Choosing the attention backend class for a device, dtype and model shape.

Mechanism shared by the engine core, workers and the ``auto`` backend: a backend class may
define two optional class-level hooks, ``unavailable_reason(device, dtype) -> str | None``
(why it cannot run here) and, for a class that stands for another registered backend,
``choose_backend(device, dtype, registry, head_dim=, block_size=) -> str``.
"""

from __future__ import annotations

from typing import Any

import torch

from vlite.core.attention import AttentionBackend
from vlite.core.errors import ConfigError

KIND = "attention_backend"


def resolve_attention_backend(
    name: str,
    device: torch.device,
    dtype: torch.dtype,
    registry: Any,
    *,
    head_dim: int | None = None,
    block_size: int | None = None,
) -> tuple[str, type[AttentionBackend]]:
    """The backend that ``name`` selects on ``device`` in ``dtype``: ``(name, class)``.

    ``auto`` (any class with ``choose_backend``) becomes its choice; every backend is then
    checked with its ``unavailable_reason``, if it has one.

    Args:
        registry: a :class:`~vlite.core.plugins.PluginRegistry`.
        head_dim, block_size: the model's, when known, so ``auto`` skips backends whose
            declared limits exclude them.

    Raises:
        ValueError: ``name`` is not registered, or the backend cannot run here; the
            message says why and what to do.
    """
    backend_cls = registry.get(KIND, name)
    choose = getattr(backend_cls, "choose_backend", None)
    if choose is not None:
        name = choose(device, dtype, registry, head_dim=head_dim, block_size=block_size)
        backend_cls = registry.get(KIND, name)
    reason = unavailable_reason(backend_cls, device, dtype)
    if reason is not None:
        raise ConfigError(
            f"attention backend {name!r} cannot run on {device.type} in "
            f"{dtype_name(dtype)}: {reason}"
        )
    return name, backend_cls


def unavailable_reason(backend_cls: Any, device: torch.device, dtype: torch.dtype) -> str | None:
    """The backend's own reason it cannot run here, or ``None``."""
    check = getattr(backend_cls, "unavailable_reason", None)
    return None if check is None else check(device, dtype)


def limits_violation(
    backend_cls: Any, dtype: torch.dtype, head_dim: int | None, block_size: int | None
) -> str | None:
    """Which declared limit (dtype, head dim, block size) excludes this shape, with what the
    backend allows (``"head dim 8; it supports: 16, 32"``), or ``None``."""
    dtypes = getattr(backend_cls, "supported_dtypes", ())
    if dtype not in dtypes:
        return f"dtype {dtype_name(dtype)}; it supports: {', '.join(map(dtype_name, dtypes))}"
    for what, value, allowed in (
        ("head dim", head_dim, getattr(backend_cls, "supported_head_dims", None)),
        ("block size", block_size, getattr(backend_cls, "supported_block_sizes", None)),
    ):
        if value is not None and allowed is not None and value not in allowed:
            return f"{what} {value}; it supports: {', '.join(map(str, allowed))}"
    return None


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def resolve_kv_cache_dtype(
    setting: str,
    model_dtype: torch.dtype,
    device: torch.device,
    backend_cls: Any,
    name: str,
    *,
    gguf: bool = False,
) -> torch.dtype:
    """The dtype of the KV cache that ``kv_cache_dtype=setting`` selects.

    ``auto``: float16 for a GGUF model computing in float32 on the CPU whose backend takes
    a float16 cache (llama.cpp's default for the same files; a decode step of many
    sequences reads their whole contexts from memory, and float16 halves the bytes; the
    agreement oracle passed it, see the README), else the model's dtype (a Hugging Face
    checkpoint keeps transformers' arithmetic).

    Raises:
        ConfigError: the backend takes no cache of that dtype (the message names those it
            takes).
    """
    taken = (model_dtype, *getattr(backend_cls, "kv_cache_dtypes", ()))
    if setting == "auto":
        prefers_half = gguf and device.type == "cpu" and model_dtype == torch.float32
        return torch.float16 if prefers_half and torch.float16 in taken else model_dtype
    dtype = getattr(torch, setting)
    if dtype not in taken:
        allowed = ", ".join(sorted({"auto", *(dtype_name(d) for d in taken)}))
        raise ConfigError(
            f"kv_cache_dtype={setting!r}: attention backend {name!r} takes no {setting} cache "
            f"with a {dtype_name(model_dtype)} model; allowed: {allowed}"
        )
    return dtype
