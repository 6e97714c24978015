"""``auto``: the best attention backend available for the device and dtype.

Preference order (:data:`AUTO_PREFERENCES`); the first backend that is registered,
available (its ``unavailable_reason(device, dtype)``, if it has one, returns ``None``) and
within its declared limits (dtype, head dim, block size) wins:

- CUDA: ``flash`` (needs the flash-attn package; float16/bfloat16) > ``triton`` > ``torch``;
- CPU: ``cpu`` (the C paged-attention kernel; float32, needs a C compiler) > ``torch``.
  (``triton`` only runs interpreted there, for tests; ``flash`` on CPU is the ``torch``
  reference pinned to PyTorch's flash SDPA kernel, which the reference's SDPA already
  picks when it is the fastest.)

Engines resolve ``auto`` with :func:`resolve_attention_backend` before building the model,
so the model holds the chosen backend and the engine can say which one it chose. The
registered :class:`AutoAttentionBackend` makes ``auto`` a name like any other (listed,
validated, conformance-tested); constructed directly, it delegates to the backend chosen
for torch's default device and dtype among the built-ins.

The two class-level hooks read here are optional, so any backend (built-in or not) may
define them: ``unavailable_reason(device, dtype) -> str | None`` on a backend, and
``choose_backend(device, dtype, registry, head_dim=, block_size=) -> str`` on a class that
stands for another registered backend.
"""

from __future__ import annotations

from typing import Any

import torch

from vlite.core.attention import AttentionBackend, AttentionMetadata
from vlite.core.attention_selection import (  # noqa: F401  (re-exported for callers)
    KIND,
    dtype_name,
    limits_violation,
    resolve_attention_backend,
    unavailable_reason,
)
from vlite.core.errors import ConfigError
from vlite.core.hookspecs import Register, hookimpl

#: Device type -> registry names, most preferred first.
AUTO_PREFERENCES: dict[str, tuple[str, ...]] = {
    "cuda": ("flash", "triton", "torch"),
    "cpu": ("cpu", "torch"),
}
_FALLBACK_PREFERENCE = ("torch",)


class AutoAttentionBackend(AttentionBackend):
    """Registry name ``auto``: stands for the best backend available (module docstring).

    Attributes:
        delegate_name: the registry name of the chosen backend.
        delegate: the chosen backend, which does the work.
    """

    supported_dtypes = (torch.float32, torch.bfloat16, torch.float16)
    supports_prefix_caching = True  # every candidate supports it
    supports_sliding_window = True  # likewise
    supports_logits_soft_cap = True  # likewise

    def __init__(
        self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, block_size: int
    ) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, scale, block_size)
        from vlite.core.plugins import PluginRegistry, build_plugin_manager

        # Models are built with their device and dtype as torch's defaults.
        registry = PluginRegistry(build_plugin_manager(load_entry_points=False))
        device, dtype = torch.get_default_device(), torch.get_default_dtype()
        self.delegate_name = self.choose_backend(
            device, dtype, registry, head_dim=head_dim, block_size=block_size
        )
        delegate_cls = registry.get(KIND, self.delegate_name)
        self.delegate: AttentionBackend = delegate_cls(
            num_heads, num_kv_heads, head_dim, scale, block_size
        )

    @classmethod
    def choose_backend(
        cls,
        device: torch.device,
        dtype: torch.dtype,
        registry: Any,
        *,
        head_dim: int | None = None,
        block_size: int | None = None,
    ) -> str:
        """The registry name of the first usable backend of :data:`AUTO_PREFERENCES`.

        Raises:
            ValueError: none is usable; the message says why for each.
        """
        registered = set(registry.names(KIND))
        reasons = []
        for name in AUTO_PREFERENCES.get(device.type, _FALLBACK_PREFERENCE):
            if name not in registered:
                reasons.append(f"{name}: not registered")
                continue
            backend_cls = registry.get(KIND, name)
            reason = unavailable_reason(backend_cls, device, dtype)
            if reason is None:
                violation = limits_violation(backend_cls, dtype, head_dim, block_size)
                reason = None if violation is None else f"does not support {violation}"
            if reason is None:
                return name
            reasons.append(f"{name}: {reason}")
        raise ConfigError(
            f"attention backend 'auto' found no backend for {device.type} in "
            f"{dtype_name(dtype)}: " + " | ".join(reasons)
        )

    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        return self.delegate.kv_cache_shape(num_blocks)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        **layer_options: Any,
    ) -> torch.Tensor:
        """The delegate's :meth:`~AttentionBackend.forward` (with the layer's
        ``sliding_window``/``logits_soft_cap``, when given)."""
        return self.delegate.forward(query, key, value, kv_cache, metadata, **layer_options)


@hookimpl
def register_attention_backends(register: Register) -> None:
    register("auto", AutoAttentionBackend)
