"""SmolLM3: the Llama decoder with no rotary embedding in every fourth layer.

A model plugin in the smallest form the ``register_models`` hook allows, and the worked
example of ``docs/models.md``: SmolLM3 is Llama (GQA, SwiGLU, RMSNorm, tied embeddings)
except that the layers whose ``no_rope_layers`` entry is 0 (by default every
``no_rope_layer_interval``-th, i.e. layers 3, 7, 11, ...) attend without positions
("NoPE"), so this class builds the Llama model and turns RoPE off in those layers.
Checkpoints load from Hugging Face folders under the same weight names as Llama's.
"""

from __future__ import annotations

from typing import Any

from vlite.core.attention import AttentionBackend
from vlite.core.errors import ConfigError
from vlite.core.hookspecs import Register, hookimpl
from vlite.distributed.parallel_state import SINGLE_RANK, TensorParallelGroup
from vlite.distributed.pipeline import SINGLE_STAGE, PipelineParallelGroup
from vlite.models.llama import LlamaForCausalLM

ARCHITECTURE = "SmolLM3ForCausalLM"


def rope_layers(hf_config: Any) -> list[bool]:
    """Whether each layer rotates its queries and keys (``no_rope_layers``; when a config
    lacks it, every ``no_rope_layer_interval``-th layer does not)."""
    flags = getattr(hf_config, "no_rope_layers", None)
    if flags is None:
        interval = getattr(hf_config, "no_rope_layer_interval", 4)
        flags = [(index + 1) % interval != 0 for index in range(hf_config.num_hidden_layers)]
    if len(flags) != hf_config.num_hidden_layers:
        raise ConfigError(
            f"smollm3: no_rope_layers has {len(flags)} entries for "
            f"{hf_config.num_hidden_layers} layers"
        )
    return [bool(flag) for flag in flags]


class SmolLM3ForCausalLM(LlamaForCausalLM):
    """:class:`~vlite.models.llama.LlamaForCausalLM` with RoPE off in the NoPE layers."""

    def __init__(
        self,
        hf_config: Any,
        attn_backend_cls: type[AttentionBackend],
        block_size: int,
        tp_group: TensorParallelGroup = SINGLE_RANK,
        pp_group: PipelineParallelGroup = SINGLE_STAGE,
    ) -> None:
        super().__init__(hf_config, attn_backend_cls, block_size, tp_group, pp_group)
        use_rope = rope_layers(hf_config)
        for index, layer in self.local_layers():
            layer.self_attn.use_rope = use_rope[index]


@hookimpl
def register_models(register: Register) -> None:
    register(ARCHITECTURE, SmolLM3ForCausalLM)
