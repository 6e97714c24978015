"""GGUF tensor names -> the Hugging Face checkpoint names vlite's model plugins load.

llama.cpp names a layer's tensors ``blk.N.<module>.weight`` whatever the architecture; the
Hugging Face name depends on it:

- most modules map one to one (``blk.3.attn_q.weight`` ->
  ``model.layers.3.self_attn.q_proj.weight``);
- the router ``ffn_gate_inp`` is Mixtral's ``block_sparse_moe.gate``, elsewhere
  ``mlp.gate``; Qwen2-MoE's shared expert is ``ffn_{gate,up,down}_shexp`` and its gate
  ``ffn_gate_inp_shexp``;
- phi3 keeps Phi-3's fused matrices: ``attn_qkv`` is ``qkv_proj`` and ``ffn_up`` is
  ``gate_up_proj`` (gate rows first; the format has no separate ``ffn_gate`` for phi3);
- Gemma 2/3 layers have four norms: ``attn_norm`` (input), ``post_attention_norm``,
  ``ffn_norm`` (before the feed-forward: ``pre_feedforward_layernorm``, not Llama's
  ``post_attention_layernorm``) and ``post_ffw_norm``;
- experts are stacked, one tensor per layer and matrix: ``blk.N.ffn_gate_exps.weight``
  ``[num_experts, inner, hidden]`` holds every expert's gate, to be split into
  ``...experts.{e}.w1.weight`` (Mixtral: w1 gate, w3 up, w2 down) or
  ``...experts.{e}.gate_proj.weight``. Mixtral files from before stacking name one expert's
  matrix ``blk.N.ffn_gate.E.weight``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

_LAYER_MODULES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}

_QWEN_MOE_MODULES = {"ffn_gate_inp": "mlp.gate"}
_GEMMA_MODULES = {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_SHARED_EXPERT_MODULES = {
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}

#: Hugging Face architecture -> its modules that differ from (or add to) the common ones.
_ARCHITECTURE_MODULES = {
    "Phi3ForCausalLM": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
    "MixtralForCausalLM": {"ffn_gate_inp": "block_sparse_moe.gate"},
    "Qwen2MoeForCausalLM": {**_QWEN_MOE_MODULES, **_SHARED_EXPERT_MODULES},
    "Qwen3MoeForCausalLM": _QWEN_MOE_MODULES,
    "OlmoeForCausalLM": _QWEN_MOE_MODULES,
    "Gemma2ForCausalLM": _GEMMA_MODULES,
    "Gemma3ForCausalLM": _GEMMA_MODULES,
}

#: Hugging Face architecture -> (experts' module, matrix name per role).
_EXPERT_NAMES = {
    "MixtralForCausalLM": ("block_sparse_moe.experts", {"gate": "w1", "up": "w3", "down": "w2"}),
    "Qwen2MoeForCausalLM": ("mlp.experts", {p: f"{p}_proj" for p in ("gate", "up", "down")}),
    "Qwen3MoeForCausalLM": ("mlp.experts", {p: f"{p}_proj" for p in ("gate", "up", "down")}),
    "OlmoeForCausalLM": ("mlp.experts", {p: f"{p}_proj" for p in ("gate", "up", "down")}),
}

_LAYER_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_STACKED_EXPERTS = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight")
_ONE_EXPERT = re.compile(r"blk\.(\d+)\.ffn_(gate|up|down)\.(\d+)\.weight")


@dataclass(frozen=True)
class ExpertTensor:
    """A GGUF tensor of experts' matrices: every expert's (``expert`` is None, stacked
    along the first dimension) or one expert's.

    Attributes:
        layer: the layer index.
        role: ``"gate"``, ``"up"`` or ``"down"``.
        expert: the one expert, or None for a stacked tensor.
    """

    layer: int
    role: str
    expert: int | None


def expert_tensor(gguf_name: str) -> ExpertTensor | None:
    """``blk.3.ffn_up_exps.weight`` -> layer 3, up, all experts; ``blk.3.ffn_up.5.weight``
    -> layer 3, up, expert 5; None for any other name."""
    match = _STACKED_EXPERTS.fullmatch(gguf_name)
    if match is not None:
        return ExpertTensor(int(match[1]), match[2], None)
    match = _ONE_EXPERT.fullmatch(gguf_name)
    if match is not None:
        return ExpertTensor(int(match[1]), match[2], int(match[3]))
    return None


def hf_expert_name(hf_architecture: str, layer: int, expert: int, role: str) -> str:
    """``("MixtralForCausalLM", 3, 5, "gate")`` ->
    ``model.layers.3.block_sparse_moe.experts.5.w1.weight``.

    Raises:
        ValueError: an architecture without experts.
    """
    if hf_architecture not in _EXPERT_NAMES:
        raise ValueError(
            f"{hf_architecture} has no experts; expert tensors belong to one of "
            f"{sorted(_EXPERT_NAMES)}"
        )
    module, matrices = _EXPERT_NAMES[hf_architecture]
    return f"model.layers.{layer}.{module}.{expert}.{matrices[role]}.weight"


def hf_weight_name(gguf_name: str, hf_architecture: str = "LlamaForCausalLM") -> str:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``.

    Expert tensors are not one Hugging Face tensor: see :func:`expert_tensor`.

    Raises:
        ValueError: a tensor name ``hf_architecture`` does not have.
    """
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    modules = {**_LAYER_MODULES, **_ARCHITECTURE_MODULES.get(hf_architecture, {})}
    match = _LAYER_NAME.fullmatch(gguf_name)
    if match is None or match.group(2) not in modules:
        raise ValueError(
            f"unknown GGUF tensor {gguf_name!r} (not a {hf_architecture} weight vlite loads)"
        )
    layer, module, kind = match.groups()
    return f"model.layers.{layer}.{modules[module]}.{kind}"
