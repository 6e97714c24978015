"""Tiny GGUF files converted from tiny Hugging Face models, as llama.cpp's converter would.

:func:`write_tiny_gguf` turns a folder from :func:`vlite.testing.tiny_models.make_tiny_model`
into a GGUF file for tests of vlite's GGUF loading. The conventions of llama.cpp's
``convert_hf_to_gguf.py`` are spelled out here independently of vlite's loader
(:mod:`vlite.models.gguf`), so that a test compares the two readings of the format:

- names: ``model.layers.N.self_attn.q_proj.weight`` -> ``blk.N.attn_q.weight`` and so on;
  a router (``block_sparse_moe.gate``, ``mlp.gate``) -> ``ffn_gate_inp``, Qwen2-MoE's shared
  expert -> ``ffn_{gate,up,down}_shexp`` and its gate -> ``ffn_gate_inp_shexp``; Phi-3's
  fused ``qkv_proj`` -> ``attn_qkv`` and ``gate_up_proj`` -> ``ffn_up``, kept fused;
- the converter's llama-family classes (Llama, Mixtral, SmolLM3) interleave the two halves
  of every Q/K head's rows (:func:`~vlite.models.gguf.permute_qk`), biases included;
- Gemma 2/3: every ``*norm.weight`` is written plus 1 (llama.cpp's RMSNorm scales by the
  stored vector, Gemma's by ``1 + weight``); the sandwich norms are ``post_attention_norm``,
  ``ffn_norm`` (pre-feedforward) and ``post_ffw_norm``; Gemma 2's ``lm_head`` is dropped;
- experts are stacked, ``blk.N.ffn_gate_exps.weight`` ``[num_experts, inner, hidden]``
  (Mixtral's w1 is the gate, w3 the up, w2 the down matrix), or, as in Mixtral files from
  before stacking, one tensor per expert, ``blk.N.ffn_gate.E.weight``;
- dimensions of size 1 are squeezed (Qwen2-MoE's shared expert gate is ``[hidden]``);
- metadata: the keys each converter class writes, including its quirks: OLMoE's RMS norm
  epsilon is written as 1e-5 whatever the config says and its ``clip_qkv`` not at
  all; SmolLM3's no-RoPE layers are not written (llama.cpp fixes them: every 4th layer),
  nor Gemma's query scale or layer pattern (llama.cpp derives them: ``head_dim`` but for
  27B models, one global layer in 2 or 6); Gemma 2 writes no RoPE base (10000), Gemma 3
  its global base and linear scaling and, from its per-layer-type RoPE, the local base
  (``rope.freq_base_swa``). A test model must therefore match what the file can say (e.g.
  OLMoE with ``rms_norm_eps=1e-5, clip_qkv=None``) for the two to compute the same thing.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from vlite.models.gguf import permute_qk
from vlite.models.gguf_config import GGUF_ARCHITECTURES
from vlite.testing.tiny_models import CHAT_TEMPLATE

#: Hugging Face architecture -> the ``general.architecture`` llama.cpp's converter writes:
#: what vlite's reader maps back (``GGUF_ARCHITECTURES``), and ``llama`` for Mixtral (a
#: ``llama`` file with experts).
GGUF_ARCHITECTURE = {hf: gguf for gguf, hf in GGUF_ARCHITECTURES.items()} | {
    "MixtralForCausalLM": "llama"
}

#: The architectures the converter writes through its Llama class, which permutes Q/K.
PERMUTED_QK = frozenset({"LlamaForCausalLM", "MixtralForCausalLM", "SmolLM3ForCausalLM"})

#: The architectures whose norm weights the converter writes plus 1 (its Gemma classes).
SHIFTED_NORMS = frozenset({"Gemma2ForCausalLM", "Gemma3ForCausalLM"})

#: The RMS norm epsilon the converter writes for every OLMoE model.
OLMOE_RMS_EPS = 1e-5

_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_LAYER = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.qkv_proj": "attn_qkv",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.gate_up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "block_sparse_moe.gate": "ffn_gate_inp",
    "mlp.gate": "ffn_gate_inp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
}
#: Gemma's names for its sandwich norms (``ffn_norm`` is the pre-feedforward one).
_GEMMA_LAYER = {
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}
_EXPERT = re.compile(
    r"model\.layers\.(\d+)\.(?:block_sparse_moe|mlp)\.experts\.(\d+)\.(\w+)\.weight"
)
_EXPERT_ROLE = {
    "w1": "gate",
    "w3": "up",
    "w2": "down",
    "gate_proj": "gate",
    "up_proj": "up",
    "down_proj": "down",
}
_TOKEN_NORMAL, _TOKEN_CONTROL, _TOKEN_UNUSED = 1, 3, 5


def gguf_tensor_name(hf_name: str, architecture: str = "LlamaForCausalLM") -> str:
    """``model.layers.3.self_attn.q_proj.weight`` -> ``blk.3.attn_q.weight`` (not experts)."""
    if hf_name in _GLOBAL:
        return _GLOBAL[hf_name]
    layer, module, kind = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.(\w+)", hf_name).groups()
    names = {**_LAYER, **_GEMMA_LAYER} if architecture in SHIFTED_NORMS else _LAYER
    return f"blk.{layer}.{names[module]}.{kind}"


def add_tokenizer(writer: gguf.GGUFWriter, tokenizer: Any, vocab_size: int = 0) -> None:
    """Write a byte-level BPE ``tokenizer`` (the tiny models') as ``tokenizer.ggml.*``.

    A ``vocab_size`` above the tokenizer's pads the list with unused tokens ``<|unused_N|>``,
    as converters pad a vocabulary to the embedding's rows (llama.cpp requires the two equal).
    """
    backend = json.loads(tokenizer.backend_tokenizer.to_str())["model"]
    tokens = sorted(backend["vocab"], key=backend["vocab"].get)
    special = set(tokenizer.all_special_ids)
    types = [_TOKEN_CONTROL if i in special else _TOKEN_NORMAL for i in range(len(tokens))]
    padding = max(0, vocab_size - len(tokens))
    tokens += [f"<|unused_{i}|>" for i in range(padding)]
    types += [_TOKEN_UNUSED] * padding
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in backend["merges"]])
    writer.add_bos_token_id(tokenizer.bos_token_id)
    writer.add_eos_token_id(tokenizer.eos_token_id)
    writer.add_pad_token_id(tokenizer.pad_token_id)
    writer.add_add_bos_token(True)
    writer.add_chat_template(CHAT_TEMPLATE)


def write_tiny_gguf(
    folder: Path,
    path: Path,
    extra_tensors: dict[str, np.ndarray] | None = None,
    quantize: tuple[str, str] | None = None,
    *,
    float_type: str = "F32",
    stacked_experts: bool = True,
) -> Path:
    """Convert the tiny Hugging Face model in ``folder`` to a GGUF file at ``path``.

    Args:
        extra_tensors: more tensors to write, by GGUF name.
        quantize: ``(matrix type, embedding type)``, e.g. ``("Q4_1", "Q8_0")`` as in the
            default model's file: block-quantizes every matrix (experts included).
        float_type: ``"F32"`` or ``"F16"``: the type of unquantized matrices (vectors are
            always F32, as the converter writes them).
        stacked_experts: experts as one tensor per layer and matrix (today's converter) or
            one per expert (Mixtral files from before stacking).
    """
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(folder)
    architecture = config.architectures[0]
    writer = gguf.GGUFWriter(str(path), GGUF_ARCHITECTURE[architecture])
    _add_metadata(writer, config)
    add_tokenizer(writer, AutoTokenizer.from_pretrained(folder), config.vocab_size)
    for name, tensor in gguf_tensors(config, _read_checkpoint(folder), stacked_experts):
        _add_tensor(writer, name, tensor.contiguous().numpy(), quantize, float_type)
    for name, array in (extra_tensors or {}).items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def gguf_tensors(
    config: Any, checkpoint: dict[str, torch.Tensor], stacked_experts: bool = True
) -> Iterator[tuple[str, torch.Tensor]]:
    """``(GGUF name, tensor)`` for a Hugging Face checkpoint, laid out as the converter does."""
    architecture = config.architectures[0]
    heads = {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads}
    experts: dict[tuple[int, str], dict[int, torch.Tensor]] = {}
    for name, tensor in checkpoint.items():
        if name == "lm_head.weight" and (
            config.tie_word_embeddings or architecture == "Gemma2ForCausalLM"
        ):
            continue
        match = _EXPERT.fullmatch(name)
        if match is not None:
            layer, expert, role = int(match[1]), int(match[2]), _EXPERT_ROLE[match[3]]
            if stacked_experts:
                experts.setdefault((layer, role), {})[expert] = tensor
            else:
                yield f"blk.{layer}.ffn_{role}.{expert}.weight", tensor
            continue
        projection = name.rsplit(".", 2)[-2]
        if architecture in PERMUTED_QK and projection in heads:
            tensor = permute_qk(tensor, heads[projection])
        if architecture in SHIFTED_NORMS and name.endswith("norm.weight"):
            tensor = tensor + 1
        name = gguf_tensor_name(name, architecture)
        yield name, tensor.squeeze() if tensor.dim() > 1 else tensor
    if stacked_experts:
        for (layer, role), by_expert in sorted(experts.items()):
            stacked = torch.stack([by_expert[e] for e in sorted(by_expert)])
            yield f"blk.{layer}.ffn_{role}_exps.weight", stacked


def _read_checkpoint(folder: Path) -> dict[str, torch.Tensor]:
    """The folder's safetensors, float32, under the checkpoint's names (as the converter
    reads them: Hugging Face's per-expert names, not a loaded model's fused ones)."""
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(Path(folder).glob("*.safetensors")):
        tensors.update(load_file(file))
    return {name: tensor.float() for name, tensor in tensors.items()}


def _head_dim(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _add_metadata(writer: gguf.GGUFWriter, config: Any) -> None:
    architecture = config.architectures[0]
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    if architecture in SHIFTED_NORMS:
        _add_gemma_metadata(writer, config)
        return
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    if architecture == "OlmoeForCausalLM":
        writer.add_layer_norm_rms_eps(OLMOE_RMS_EPS)
    else:
        writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    if architecture == "Phi3ForCausalLM":
        _add_phi3_metadata(writer, config)
        return
    writer.add_key_length(_head_dim(config))
    writer.add_value_length(_head_dim(config))
    if architecture in PERMUTED_QK:
        writer.add_vocab_size(config.vocab_size)
        writer.add_rope_dimension_count(_head_dim(config))
    num_experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", 0)
    if num_experts:
        writer.add_expert_count(num_experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
    if getattr(config, "moe_intermediate_size", None):
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    if getattr(config, "shared_expert_intermediate_size", None):
        writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)


def _add_gemma_metadata(writer: gguf.GGUFWriter, config: Any) -> None:
    """The converter's Gemma keys. Neither class writes ``query_pre_attn_scalar`` or the
    layer pattern; Gemma 2's writes no RoPE keys at all."""
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    if config.architectures[0] == "Gemma2ForCausalLM":
        writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
        writer.add_sliding_window(config.sliding_window)
        return
    global_rope = config.rope_parameters["full_attention"]
    writer.add_rope_freq_base(global_rope["rope_theta"])
    writer.add_rope_freq_base_swa(config.rope_parameters["sliding_attention"]["rope_theta"])
    if global_rope.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(global_rope["factor"])
    if config.final_logit_softcapping:
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
    if "sliding_attention" in config.layer_types:
        writer.add_sliding_window(config.sliding_window)


def _add_phi3_metadata(writer: gguf.GGUFWriter, config: Any) -> None:
    partial = config.rope_parameters.get("partial_rotary_factor", 1.0)
    writer.add_rope_dimension_count(int(partial * config.hidden_size) // config.num_attention_heads)
    writer.add_rope_scaling_orig_ctx_len(config.original_max_position_embeddings)
    writer.add_sliding_window(config.sliding_window or 0)


def _add_tensor(
    writer: gguf.GGUFWriter,
    name: str,
    array: np.ndarray,
    quantize: tuple[str, str] | None,
    float_type: str,
) -> None:
    if array.ndim < 2:
        writer.add_tensor(name, array.astype(np.float32))
    elif quantize is not None:
        kind = gguf.GGMLQuantizationType[quantize[1] if "token_embd" in name else quantize[0]]
        writer.add_tensor(name, gguf.quants.quantize(array, kind), raw_dtype=kind)
    else:
        writer.add_tensor(name, array.astype(np.float16 if float_type == "F16" else np.float32))


#: Byte offsets of the fp16 fields (scales, minimums) in one block of each quantized GGUF
#: type with kernels (:data:`vlite.kernels.native.BLOCK_LAYOUTS`).
FP16_FIELDS = {
    "Q4_0": (0,),
    "Q4_1": (0, 2),
    "Q8_0": (0,),
    "Q5_0": (0,),
    "Q5_1": (0, 2),
    "IQ4_NL": (0,),
    "Q2_K": (80, 82),
    "Q3_K": (108,),
    "Q4_K": (0, 2),
    "Q5_K": (0, 2),
    "Q6_K": (208,),
    "IQ4_XS": (0,),
}


def random_quantized_matrix(
    qtype: str,
    rows: int,
    cols: int,
    rng: np.random.Generator,
    scale_range: tuple[float, float] = (-0.05, 0.05),
) -> np.ndarray:
    """The stored bytes ``[rows, row_bytes]`` (``uint8``) of a random ``[rows, cols]``
    ``qtype`` matrix: every bit random but the fp16 scales, drawn from ``scale_range``
    (finite), so every bit pattern of every other field occurs. F16/BF16: random normal
    values (times ``scale_range[1]``). gguf-py cannot quantize to the K-quants or IQ4; its
    dequantization reads these bytes for every type."""
    from vlite.kernels.native import BLOCK_LAYOUTS

    kind = gguf.GGMLQuantizationType[qtype]
    if qtype in ("F16", "BF16"):
        values = rng.standard_normal((rows, cols)).astype(np.float32) * scale_range[1] / 0.05
        return gguf.quants.quantize(values, kind).view(np.uint8).reshape(rows, -1)
    layout = BLOCK_LAYOUTS[qtype]
    num_blocks = rows * cols // layout.values
    blocks = rng.integers(0, 256, (num_blocks, layout.nbytes), dtype=np.uint8)
    for offset in FP16_FIELDS[qtype]:
        scale = rng.uniform(*scale_range, num_blocks).astype(np.float16)
        blocks[:, offset : offset + 2] = scale.view(np.uint8).reshape(num_blocks, 2)
    return blocks.reshape(rows, -1)
