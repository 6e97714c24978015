"""Phi-3: the Llama decoder with fused ``qkv_proj`` and ``gate_up_proj`` in the checkpoint.

Phi-3 (and Phi-3.5/Phi-4-mini, whose ``partial_rotary_factor`` < 1 rotates only part of
each head, see :mod:`vlite.models.rope`) is the Llama block with no biases; its checkpoints
store the q/k/v projections as one ``qkv_proj`` matrix and gate/up as one
``gate_up_proj``, which vlite fuses too. :meth:`Phi3ForCausalLM.load_weights` splits them
into the pieces the (maybe tensor-parallel) fused layers load.

LongRoPE scaling (``rope_type="longrope"``: the 128k-context Phi-3 models, Phi-3.5,
Phi-4-mini) is :mod:`vlite.models.longrope`: the context is ``max_position_embeddings``, and
a sequence that outgrows ``original_max_position_embeddings`` recomputes its cached keys
once with the long factors, as transformers does. That recomputation needs every earlier
token's cache blocks, so a ``sliding_window`` shorter than ``original_max_position_embeddings``
is refused with LongRoPE. Prefix-cache blocks do not record which factors rotated their
keys: the outputs equal transformers' with prefix caching off (``enable_prefix_caching=False``)
or when every sequence stays on one side of ``original_max_position_embeddings``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from vlite.core.errors import ConfigError
from vlite.core.hookspecs import Register, hookimpl
from vlite.core.weight_format import QuantizedWeight
from vlite.models.gguf_names import LLAMA_LAYER_MODULES, PHI3_MODULES
from vlite.models.llama import LlamaForCausalLM
from vlite.models.spec import head_dim_of

ARCHITECTURE = "Phi3ForCausalLM"


class Phi3ForCausalLM(LlamaForCausalLM):
    """:class:`~vlite.models.llama.LlamaForCausalLM` loading Phi-3's fused checkpoints."""

    #: Its fused q/k/v and gate/up matrices by their GGUF names.
    gguf_layer_modules = {**LLAMA_LAYER_MODULES, **PHI3_MODULES}

    def __init__(self, hf_config: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(hf_config, *args, **kwargs)
        _check_longrope_window(hf_config, self.long_rope_threshold)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(self._split_fused(weights))

    def _split_fused(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``qkv_proj`` as ``q_proj``/``k_proj``/``v_proj`` and ``gate_up_proj`` as
        ``gate_proj``/``up_proj`` (row slices: a quantized matrix is cut by its weight
        format, and stays quantized); every other tensor as it is."""
        config = self.config
        head_dim = head_dim_of(config)
        q_rows = config.num_attention_heads * head_dim
        kv_rows = config.num_key_value_heads * head_dim
        for name, tensor in weights:
            prefix, _, leaf = name.rpartition(".")
            module_prefix, _, projection = prefix.rpartition(".")
            if projection in ("qkv_proj", "gate_up_proj"):
                _check_rows(name, tensor, q_rows + 2 * kv_rows, 2 * config.intermediate_size)
            if projection == "qkv_proj":
                q, k, v = _split_rows(tensor, [q_rows, kv_rows, kv_rows])
                for piece, part in (("q_proj", q), ("k_proj", k), ("v_proj", v)):
                    yield f"{module_prefix}.{piece}.{leaf}", part
            elif projection == "gate_up_proj":
                gate, up = _split_rows(tensor, [config.intermediate_size] * 2)
                yield f"{module_prefix}.gate_proj.{leaf}", gate
                yield f"{module_prefix}.up_proj.{leaf}", up
            else:
                yield name, tensor


def _check_longrope_window(hf_config: Any, long_rope_threshold: int | None) -> None:
    """Refuse a window too short to keep the blocks LongRoPE recomputes (see the module
    docstring)."""
    window = getattr(hf_config, "sliding_window", None)
    if long_rope_threshold is not None and window and window < long_rope_threshold:
        raise ConfigError(
            f"sliding_window={window} is shorter than LongRoPE's "
            f"original_max_position_embeddings={long_rope_threshold}, which vlite does not "
            "support: a sequence outgrowing it recomputes every earlier token; use a config "
            f"with sliding_window >= {long_rope_threshold} or without one"
        )


def _split_rows(
    tensor: torch.Tensor | QuantizedWeight, sizes: list[int]
) -> list[torch.Tensor | QuantizedWeight]:
    """Consecutive row slices of ``sizes`` rows (views of a tensor; a quantized weight's
    slices by its format)."""
    starts = [sum(sizes[:index]) for index in range(len(sizes))]
    return [tensor.narrow(0, start, size) for start, size in zip(starts, sizes)]


def _check_rows(name: str, tensor: torch.Tensor, qkv_rows: int, gate_up_rows: int) -> None:
    expected = qkv_rows if name.rsplit(".", 2)[-2] == "qkv_proj" else gate_up_rows
    if tensor.shape[0] != expected:
        raise ConfigError(
            f"weight {name!r} has {tensor.shape[0]} rows, expected {expected} (the fused "
            "projections of this config)"
        )


@hookimpl
def register_models(register: Register) -> None:
    register(ARCHITECTURE, Phi3ForCausalLM)
