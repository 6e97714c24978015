"""GGUF tensor names -> the Hugging Face checkpoint names vlite's model plugins load.

A model class names the tensors of a GGUF file itself: the GGUF loader asks its classmethod
``hf_name_for_gguf_tensor(gguf_name, expert=None)``. The Llama family's implementation
(inherited by every built-in model) is :func:`hf_name_for_gguf_tensor` over two class
attributes, a table of layer modules and the experts' names, built from the tables here:

llama.cpp names a layer's tensors ``blk.N.<module>.weight`` whatever the architecture; the
Hugging Face name depends on it:

- most modules map one to one (``blk.3.attn_q.weight`` ->
  ``model.layers.3.self_attn.q_proj.weight``: :data:`LLAMA_LAYER_MODULES`);
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
  ``...experts.{e}.gate_proj.weight`` (:class:`ExpertNames`). Mixtral files from before
  stacking name one expert's matrix ``blk.N.ffn_gate.E.weight``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from vlite.core.errors import ConfigError

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

#: GGUF layer module -> Hugging Face module, for the Llama family (Llama, Mistral, Qwen2,
#: Qwen3, SmolLM3): the default table of ``LlamaForCausalLM.gguf_layer_modules``.
LLAMA_LAYER_MODULES: Mapping[str, str] = {
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

#: What Phi-3 changes: its fused q/k/v and gate/up matrices.
PHI3_MODULES: Mapping[str, str] = {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"}
#: Mixtral's router.
MIXTRAL_MODULES: Mapping[str, str] = {"ffn_gate_inp": "block_sparse_moe.gate"}
#: The Qwen-MoE and OLMoE router, and Qwen2-MoE's shared expert and its gate.
QWEN_MOE_MODULES: Mapping[str, str] = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
#: Gemma 2/3's four norms per layer.
GEMMA_MODULES: Mapping[str, str] = {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}


@dataclass(frozen=True)
class ExpertNames:
    """How a mixture's checkpoint names its experts' matrices.

    Attributes:
        module: the experts' module within a layer (``"mlp.experts"``).
        matrices: role (``"gate"``, ``"up"``, ``"down"``) -> the matrix's name
            (``"gate_proj"``; Mixtral: ``"w1"``, ``"w3"``, ``"w2"``).
    """

    module: str
    matrices: Mapping[str, str]

    def name(self, layer: int, expert: int, role: str) -> str:
        """``model.layers.{layer}.{module}.{expert}.{matrices[role]}.weight``."""
        return f"model.layers.{layer}.{self.module}.{expert}.{self.matrices[role]}.weight"


#: Mixtral's experts: ``block_sparse_moe.experts.{e}.w1/w3/w2``.
MIXTRAL_EXPERTS = ExpertNames("block_sparse_moe.experts", {"gate": "w1", "up": "w3", "down": "w2"})
#: Qwen-MoE's and OLMoE's experts: ``mlp.experts.{e}.gate_proj/up_proj/down_proj``.
PROJ_EXPERTS = ExpertNames("mlp.experts", {p: f"{p}_proj" for p in ("gate", "up", "down")})

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


def hf_name_for_gguf_tensor(
    gguf_name: str,
    expert: int | None = None,
    *,
    layer_modules: Mapping[str, str] = LLAMA_LAYER_MODULES,
    experts: ExpertNames | None = None,
    owner: str = "LlamaForCausalLM",
) -> str:
    """The Hugging Face name of GGUF tensor ``gguf_name``: ``blk.3.attn_q.weight`` ->
    ``model.layers.3.self_attn.q_proj.weight``; with ``expert``, that expert's matrix of a
    stacked experts tensor (``blk.3.ffn_up_exps.weight``, expert 5 ->
    ``model.layers.3.mlp.experts.5.up_proj.weight``).

    Args:
        layer_modules: GGUF layer module -> Hugging Face module.
        experts: how the model names its experts (``None``: it has none).
        owner: the model class, named in errors.

    Raises:
        ValueError: a tensor the model does not have (an expert tensor of a model without
            experts; a stacked experts tensor without ``expert`` or another tensor with
            one), naming it and the model class.
    """
    parsed = expert_tensor(gguf_name)
    if parsed is not None:
        if experts is None:
            raise ValueError(f"{owner} has no experts; {gguf_name!r} is an expert tensor")
        if parsed.expert is None and expert is None:
            raise ValueError(f"{gguf_name!r} stacks every expert's matrix: name one expert's")
        if parsed.expert is not None and expert is not None:
            raise ValueError(
                f"{gguf_name!r} holds expert {parsed.expert}'s matrix alone, not expert {expert}'s"
            )
        index = parsed.expert if parsed.expert is not None else expert
        return experts.name(parsed.layer, index, parsed.role)
    if expert is not None:
        raise ValueError(f"{gguf_name!r} is not a stacked experts tensor (got expert={expert})")
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_NAME.fullmatch(gguf_name)
    if match is None or match.group(2) not in layer_modules:
        raise ConfigError(f"unknown GGUF tensor {gguf_name!r} (not a {owner} weight vlite loads)")
    layer, module, kind = match.groups()
    return f"model.layers.{layer}.{layer_modules[module]}.{kind}"


def hf_weight_name(gguf_name: str, hf_architecture: str = "LlamaForCausalLM") -> str:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight`` as the model
    class vlite registers for ``hf_architecture`` names it (its
    ``hf_name_for_gguf_tensor``). Expert tensors need an expert: ask the class.

    Raises:
        ValueError: a tensor name that architecture does not have.
    """
    from vlite.models.gguf import builtin_model_class, tensor_namer

    return tensor_namer(builtin_model_class(hf_architecture))(gguf_name)
