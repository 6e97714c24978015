"""A ``transformers`` config rebuilt from a GGUF file's metadata, one builder per architecture.

llama.cpp's converter writes a model's hyperparameters as ``<arch>.<key>`` metadata
(``qwen2moe.expert_count``, ``phi3.rope.dimension_count``, ...); each builder here reads
back what its Hugging Face config class needs. Some of a config is in no key but fixed by
the architecture, as llama.cpp runs it, and is set here the same way:

- Mixtral is written as ``llama`` with ``llama.expert_count`` > 0;
- ``smollm3``: every 4th layer attends without RoPE (llama.cpp hard-codes that step;
  the format has no key for SmolLM3's ``no_rope_layers``);
- ``qwen3moe`` renormalizes its top-k routing weights, ``qwen2moe`` and ``olmoe`` do not,
  unless ``<arch>.expert_weights_norm`` says otherwise;
- ``olmoe`` clamps q/k/v only when ``olmoe.attention.clamp_kqv`` is set (the converter
  does not write it: llama.cpp runs OLMoE unclamped);
- a mixture layer is one with a router (``blk.N.ffn_gate_inp.weight``); Qwen-MoE layers
  without one are dense (``mlp_only_layers``);
- Gemma (``gemma2``, ``gemma3``): see :func:`_gemma_fields`. The converter writes no query
  scale, no layer pattern and (before its per-layer-type RoPE) no local RoPE base: llama.cpp
  fixes them, and so does this module.

Sizes the format may leave out are read from the tensors they size, which is exact: the
vocabulary (from the embedding), an expert's width when ``expert_feed_forward_length`` is
absent (llama.cpp's converter writes none for Mixtral and OLMoE), the shared expert's. What
is needed and neither stated nor fixed by the architecture (e.g. ``expert_used_count``)
raises an error naming the key.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vlite.core.errors import ConfigError

if TYPE_CHECKING:
    from vlite.models.gguf import GGUFFile

#: GGUF ``general.architecture`` -> Hugging Face architecture (class) name. A ``llama``
#: file with experts is Mixtral (:func:`hf_architecture`).
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "smollm3": "SmolLM3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "qwen2moe": "Qwen2MoeForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "olmoe": "OlmoeForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}

#: llama.cpp's SmolLM3 skips RoPE in every layer ``i`` with ``(i + 1) % 4 == 0``.
SMOLLM3_NO_ROPE_LAYER_INTERVAL = 4

#: ``<arch>.expert_gating_func`` value of a softmax router (gguf's ExpertGatingFuncType).
_SOFTMAX_GATING = 1

#: llama.cpp's Gemma layer pattern, in runs of this many layers: all local (sliding window)
#: but the last, which is global. Files state no pattern; one that does
#: (``attention.sliding_window_pattern``) is read instead.
GEMMA_LOCAL_PERIOD = {"gemma2": 2, "gemma3": 6}

#: llama.cpp tells Gemma's 27B models by their layer count and scales their queries by
#: ``hidden_size // num_heads``; every other size by ``head_dim`` (``query_pre_attn_scalar``).
GEMMA_27B_LAYER_COUNT = {"gemma2": 46, "gemma3": 62}

#: Gemma 3's local RoPE base where the file states none (``rope.freq_base_swa``): llama.cpp's.
GEMMA3_LOCAL_ROPE_BASE = 10000.0

#: What llama.cpp (and Gemma 2's Hugging Face config) assume where a gemma2 file is silent.
_GEMMA2_DEFAULTS = {
    "attention.sliding_window": 4096,
    "attn_logit_softcapping": 50.0,
    "final_logit_softcapping": 30.0,
}

#: Gemma's feed-forward activation: llama.cpp's GELU is the tanh approximation.
_GELU_TANH = "gelu_pytorch_tanh"

#: Hugging Face architectures whose config class is not ``<name>Config`` (Gemma3Config is
#: the multimodal model's).
_CONFIG_CLASSES = {"Gemma3ForCausalLM": "Gemma3TextConfig"}

#: Hugging Face architecture -> the ``rope.scaling.type`` values its files may carry (Gemma 3:
#: linear scaling of the global layers, as in the 4B-27B checkpoints).
_ROPE_SCALING_TYPES = {"Gemma3ForCausalLM": ("linear",)}

_TENSOR_ONLY_ROPE_SCALING = {
    "rope_freqs.weight": "per-frequency RoPE factors (rope_freqs.weight, as in Llama 3.1 "
    "GGUF files) are not supported; load the Hugging Face checkpoint instead",
    "rope_factors_long.weight": "LongRoPE factors (rope_factors_long.weight, as in 128k-context "
    "Phi-3 GGUF files) are not supported; load the Hugging Face checkpoint instead",
}


def hf_architecture(gguf_file: GGUFFile) -> str:
    """The Hugging Face architecture of the model in ``gguf_file``.

    Raises:
        ValueError: an architecture vlite cannot load from GGUF (the message lists those
            it can).
    """
    architecture = gguf_file.architecture
    if architecture not in GGUF_ARCHITECTURES:
        raise ConfigError(
            f"{gguf_file.path}: GGUF architecture {architecture!r} is not supported "
            f"(supported: {', '.join(sorted(GGUF_ARCHITECTURES))}; Mixtral as llama with "
            "llama.expert_count > 0)"
        )
    if architecture == "llama" and int(gguf_file.arch_value("expert_count", 0)) > 0:
        return "MixtralForCausalLM"
    return GGUF_ARCHITECTURES[architecture]


def gguf_hf_config(gguf_file: GGUFFile) -> Any:
    """A ``transformers`` config for the model in ``gguf_file``, built from its metadata.

    Raises:
        ValueError: an unsupported architecture, or metadata the model needs is missing
            (the message names the key).
        NotImplementedError: what vlite cannot run from a GGUF file: RoPE scaling
            (``rope.scaling.*`` metadata but Gemma 3's linear scaling, ``rope_freqs``/
            ``rope_factors_long`` tensors), partial rotary embeddings outside phi3, routers
            other than softmax, Gemma files stating what llama.cpp fixes otherwise.
    """
    import transformers

    architecture = hf_architecture(gguf_file)
    _check_rope_scaling(gguf_file, architecture)
    fields = _common_fields(gguf_file, architecture)
    fields.update(_FIELD_BUILDERS[architecture](gguf_file, fields))
    config_name = _CONFIG_CLASSES.get(architecture, architecture.replace("ForCausalLM", "Config"))
    config_cls = getattr(transformers, config_name)
    return config_cls(**fields)


def _check_rope_scaling(gguf_file: GGUFFile, architecture: str) -> None:
    scaling = gguf_file.arch_value("rope.scaling.type", "none")
    supported = _ROPE_SCALING_TYPES.get(architecture, ())
    if scaling != "none" and scaling not in supported:
        raise NotImplementedError(
            f"{gguf_file.path}: RoPE scaling {scaling!r} in a GGUF file is not supported "
            f"for {gguf_file.architecture} (supported: {', '.join(('none', *supported))})"
        )
    for tensor_name, why in _TENSOR_ONLY_ROPE_SCALING.items():
        if tensor_name in gguf_file.tensor_names:
            raise NotImplementedError(f"{gguf_file.path}: {why}")


# ---- fields every architecture has --------------------------------------------------------


def _common_fields(gguf_file: GGUFFile, architecture: str) -> dict[str, Any]:
    value = gguf_file.arch_value
    num_heads = int(value("attention.head_count"))
    hidden_size = int(value("embedding_length"))
    fields: dict[str, Any] = {
        "architectures": [architecture],
        # The embedding's rows are the truth; the vocab_size key is optional in GGUF.
        "vocab_size": gguf_file.hf_shape("token_embd.weight")[0],
        "hidden_size": hidden_size,
        "num_hidden_layers": int(value("block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(value("attention.head_count_kv", num_heads)),
        "head_dim": int(value("attention.key_length", hidden_size // num_heads)),
        "max_position_embeddings": int(value("context_length")),
        "rms_norm_eps": float(value("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(value("rope.freq_base", 10000.0)),
        "hidden_act": "silu",
        "tie_word_embeddings": "output.weight" not in gguf_file.tensor_names,
    }
    if architecture != "Phi3ForCausalLM":  # the one architecture with partial rotary
        _check_whole_head_rotary(gguf_file, fields["head_dim"])
    for name in ("bos", "eos", "padding", "unknown"):
        token_id = gguf_file.metadata.get(f"tokenizer.ggml.{name}_token_id")
        if token_id is not None:
            hf_name = {"padding": "pad", "unknown": "unk"}.get(name, name)
            fields[f"{hf_name}_token_id"] = int(token_id)
    return fields


def _rotary_dims(gguf_file: GGUFFile, head_dim: int) -> int:
    """``rope.dimension_count`` (llama.cpp's default: the whole head), checked."""
    rotary = int(gguf_file.arch_value("rope.dimension_count", head_dim))
    if not 0 < rotary <= head_dim or rotary % 2:
        raise ConfigError(
            f"{gguf_file.path}: {gguf_file.architecture}.rope.dimension_count={rotary} is "
            f"invalid for heads of {head_dim} dimensions (expected an even count in "
            f"2..{head_dim})"
        )
    return rotary


def _check_whole_head_rotary(gguf_file: GGUFFile, head_dim: int) -> None:
    rotary = _rotary_dims(gguf_file, head_dim)
    if rotary != head_dim:
        raise NotImplementedError(
            f"{gguf_file.path}: {gguf_file.architecture}.rope.dimension_count={rotary} "
            f"rotates part of each {head_dim}-dimension head; vlite supports that in GGUF "
            "files of architecture phi3 only"
        )


def _attention_bias(gguf_file: GGUFFile) -> bool:
    return "blk.0.attn_q.bias" in gguf_file.tensor_names


def _feed_forward_length(gguf_file: GGUFFile) -> int:
    return int(gguf_file.arch_value("feed_forward_length"))


# ---- dense architectures ------------------------------------------------------------------


def _llama_fields(gguf_file: GGUFFile, common: dict[str, Any]) -> dict[str, Any]:
    return {
        "intermediate_size": _feed_forward_length(gguf_file),
        "attention_bias": _attention_bias(gguf_file),
        "mlp_bias": "blk.0.ffn_up.bias" in gguf_file.tensor_names,
    }


def _qwen2_fields(gguf_file: GGUFFile, common: dict[str, Any]) -> dict[str, Any]:
    # Qwen2 always has q/k/v biases; its config has no flag.
    return {"intermediate_size": _feed_forward_length(gguf_file)}


def _qwen3_fields(gguf_file: GGUFFile, common: dict[str, Any]) -> dict[str, Any]:
    return {
        "intermediate_size": _feed_forward_length(gguf_file),
        "attention_bias": _attention_bias(gguf_file),
    }


def _smollm3_fields(gguf_file: GGUFFile, common: dict[str, Any]) -> dict[str, Any]:
    interval = SMOLLM3_NO_ROPE_LAYER_INTERVAL
    layers = range(common["num_hidden_layers"])
    return {
        **_llama_fields(gguf_file, common),
        "no_rope_layer_interval": interval,
        "no_rope_layers": [int((index + 1) % interval != 0) for index in layers],
        "use_sliding_window": False,
        "sliding_window": None,
    }


def _phi3_fields(gguf_file: GGUFFile, common: dict[str, Any]) -> dict[str, Any]:
    value = gguf_file.arch_value
    head_dim = common["head_dim"]
    rotary = _rotary_dims(gguf_file, head_dim)
    factor = rotary / head_dim
    if int(head_dim * factor) != rotary:  # what vlite's RotaryEmbedding will compute
        raise ConfigError(
            f"{gguf_file.path}: phi3.rope.dimension_count={rotary} of {head_dim} is not "
            "representable as a partial_rotary_factor"
        )
    return {
        "intermediate_size": _feed_forward_length(gguf_file),
        "partial_rotary_factor": factor,
        # The converter writes 0 for "no window" (Phi-4-mini).
        "sliding_window": int(value("attention.sliding_window", 0)) or None,
        "original_max_position_embeddings": int(
            value("rope.scaling.original_context_length", common["max_position_embeddings"])
        ),
    }


# ---- mixtures of experts ------------------------------------------------------------------


def _expert_counts(gguf_file: GGUFFile) -> tuple[int, int]:
    """``(experts per layer, experts per token)``; also checks the router is a softmax."""
    value = gguf_file.arch_value
    gating = int(value("expert_gating_func", _SOFTMAX_GATING))
    if gating != _SOFTMAX_GATING:
        raise NotImplementedError(
            f"{gguf_file.path}: {gguf_file.architecture}.expert_gating_func={gating} is not "
            f"supported (vlite routes with a softmax, value {_SOFTMAX_GATING})"
        )
    scale = float(value("expert_weights_scale", 1.0))
    if scale != 1.0:
        raise NotImplementedError(
            f"{gguf_file.path}: {gguf_file.architecture}.expert_weights_scale={scale} is not "
            "supported (vlite weighs experts by their routing probabilities, scale 1.0)"
        )
    return int(value("expert_count")), int(value("expert_used_count"))


def _expert_width(gguf_file: GGUFFile) -> int:
    """One expert's inner width: ``expert_feed_forward_length``, else the experts' shape."""
    width = gguf_file.arch_value("expert_feed_forward_length", None)
    if width is not None:
        return int(width)
    for name in ("ffn_gate_exps.weight", "ffn_gate.0.weight"):  # stacked; one per expert
        for layer in range(int(gguf_file.arch_value("block_count"))):
            shape = gguf_file.hf_shape(f"blk.{layer}.{name}")
            if shape is not None:
                return shape[-2]
    raise ConfigError(
        f"{gguf_file.path}: GGUF file has neither {gguf_file.architecture}."
        "expert_feed_forward_length nor expert tensors (blk.N.ffn_gate_exps.weight)"
    )


def _dense_layers(gguf_file: GGUFFile) -> list[int]:
    """The layers with no router (``blk.N.ffn_gate_inp.weight``): a plain MLP."""
    names = gguf_file.tensor_names
    num_layers = int(gguf_file.arch_value("block_count"))
    return [i for i in range(num_layers) if f"blk.{i}.ffn_gate_inp.weight" not in names]


def _check_every_layer_has_experts(gguf_file: GGUFFile) -> None:
    dense = _dense_layers(gguf_file)
    if dense:
        raise ConfigError(
            f"{gguf_file.path}: layers {dense} have no router (blk.N.ffn_gate_inp.weight); "
            f"a {gguf_file.architecture} mixture of experts has one in every layer"
        )


def _norm_topk_prob(gguf_file: GGUFFile, architecture_default: bool) -> bool:
    return bool(gguf_file.arch_value("expert_weights_norm", architecture_default))


def _mixtral_fields(gguf_file: GGUFFile, common: dict[str, Any]) -> dict[str, Any]:
    num_experts, top_k = _expert_counts(gguf_file)
    _check_every_layer_has_experts(gguf_file)
    return {
        "num_local_experts": num_experts,
        "num_experts_per_tok": top_k,
        "intermediate_size": _expert_width(gguf_file),  # Mixtral's is one expert's
        "sliding_window": None,  # llama.cpp's llama attends over the whole context
    }


def _qwen_moe_fields(gguf_file: GGUFFile, renormalize: bool) -> dict[str, Any]:
    num_experts, top_k = _expert_counts(gguf_file)
    dense = _dense_layers(gguf_file)
    fields: dict[str, Any] = {
        "num_experts": num_experts,
        "num_experts_per_tok": top_k,
        "moe_intermediate_size": _expert_width(gguf_file),
        "norm_topk_prob": _norm_topk_prob(gguf_file, renormalize),
        "decoder_sparse_step": 1,
        "mlp_only_layers": dense,
        "use_sliding_window": False,
    }
    width = gguf_file.arch_value("feed_forward_length", None)
    if width is not None:
        fields["intermediate_size"] = int(width)
    elif dense:
        raise ConfigError(
            f"{gguf_file.path}: layers {dense} are dense but the GGUF metadata has no "
            f"{gguf_file.architecture}.feed_forward_length"
        )
    return fields


def _shared_expert_width(gguf_file: GGUFFile) -> int:
    """``expert_shared_feed_forward_length``, else the shared expert's shape (0: none)."""
    width = gguf_file.arch_value("expert_shared_feed_forward_length", None)
    if width is not None:
        return int(width)
    for layer in range(int(gguf_file.arch_value("block_count"))):
        shape = gguf_file.hf_shape(f"blk.{layer}.ffn_up_shexp.weight")
        if shape is not None:
            return shape[0]
    return 0


def _qwen2moe_fields(gguf_file: GGUFFile, common: dict[str, Any]) -> dict[str, Any]:
    return {
        **_qwen_moe_fields(gguf_file, renormalize=False),
        "shared_expert_intermediate_size": _shared_expert_width(gguf_file),
        "qkv_bias": _attention_bias(gguf_file),
    }


def _qwen3moe_fields(gguf_file: GGUFFile, common: dict[str, Any]) -> dict[str, Any]:
    return {
        **_qwen_moe_fields(gguf_file, renormalize=True),
        "attention_bias": _attention_bias(gguf_file),
    }


def _olmoe_fields(gguf_file: GGUFFile, common: dict[str, Any]) -> dict[str, Any]:
    num_experts, top_k = _expert_counts(gguf_file)
    _check_every_layer_has_experts(gguf_file)
    clip = gguf_file.arch_value("attention.clamp_kqv", None)
    return {
        "num_experts": num_experts,
        "num_experts_per_tok": top_k,
        "intermediate_size": _expert_width(gguf_file),  # OLMoE's is one expert's
        "norm_topk_prob": _norm_topk_prob(gguf_file, False),
        "clip_qkv": None if clip is None else float(clip),
        "attention_bias": _attention_bias(gguf_file),
    }


# ---- Gemma 2 and Gemma 3 -------------------------------------------------------------------


def _gemma_fields(
    gguf_file: GGUFFile, common: dict[str, Any], window: int | None
) -> dict[str, Any]:
    """What Gemma 2 and Gemma 3 share: GeGLU, the query scale, local and global layers.

    ``window``: the local layers' sliding window; None: every layer global.
    """
    return {
        "intermediate_size": _feed_forward_length(gguf_file),
        "hidden_activation": _GELU_TANH,
        "hidden_act": _GELU_TANH,
        "attention_bias": _attention_bias(gguf_file),
        "query_pre_attn_scalar": _query_pre_attn_scalar(gguf_file, common),
        "sliding_window": window,
        "layer_types": _gemma_layer_types(gguf_file, common["num_hidden_layers"], window),
    }


def _query_pre_attn_scalar(gguf_file: GGUFFile, common: dict[str, Any]) -> int:
    """The query scale llama.cpp derives: ``hidden // heads`` for a 27B model (told by its
    layer count), else ``head_dim``. A file stating its own scale is refused."""
    stated = gguf_file.arch_value("attention.scale", None)
    if stated is not None:
        raise NotImplementedError(
            f"{gguf_file.path}: {gguf_file.architecture}.attention.scale={stated} is not "
            "supported: llama.cpp ignores it for Gemma and derives the scale from the model "
            "size, and vlite cannot tell which of the two the file means"
        )
    if common["num_hidden_layers"] == GEMMA_27B_LAYER_COUNT[gguf_file.architecture]:
        return common["hidden_size"] // common["num_attention_heads"]
    return common["head_dim"]


def _gemma_layer_types(gguf_file: GGUFFile, num_layers: int, window: int | None) -> list[str]:
    """``"sliding_attention"``/``"full_attention"`` per layer: the file's
    ``attention.sliding_window_pattern`` (a period, or one bool per layer, true: local) or
    llama.cpp's fixed period (:data:`GEMMA_LOCAL_PERIOD`); all global without a window."""
    if window is None:
        return ["full_attention"] * num_layers
    pattern = gguf_file.arch_value(
        "attention.sliding_window_pattern", GEMMA_LOCAL_PERIOD[gguf_file.architecture]
    )
    if isinstance(pattern, list):
        local = [bool(is_local) for is_local in pattern]
    else:
        local = [_is_local_in_period(index, int(pattern)) for index in range(num_layers)]
    if len(local) != num_layers:
        raise ConfigError(
            f"{gguf_file.path}: {gguf_file.architecture}.attention.sliding_window_pattern "
            f"lists {len(local)} layers; the model has {num_layers}"
        )
    return ["sliding_attention" if is_local else "full_attention" for is_local in local]


def _is_local_in_period(index: int, period: int) -> bool:
    """Layer ``index`` in runs of ``period`` layers, the last of each global (llama.cpp's
    reading of a period; 0: every layer local)."""
    return period == 0 or index % period < period - 1


def _sliding_window(gguf_file: GGUFFile, default: int | None) -> int | None:
    """``attention.sliding_window``, else ``default``; None (no window) for 0 or neither."""
    return int(gguf_file.arch_value("attention.sliding_window", default) or 0) or None


def _soft_cap(gguf_file: GGUFFile, key: str, default: float | None) -> float | None:
    """A ``<arch>.<key>`` soft cap, else ``default`` (None: no cap)."""
    cap = gguf_file.arch_value(key, default)
    return None if cap is None else float(cap)


def _gemma2_fields(gguf_file: GGUFFile, common: dict[str, Any]) -> dict[str, Any]:
    defaults = _GEMMA2_DEFAULTS
    local_base = gguf_file.arch_value("rope.freq_base_swa", common["rope_theta"])
    if float(local_base) != common["rope_theta"]:
        raise NotImplementedError(
            f"{gguf_file.path}: gemma2.rope.freq_base_swa={local_base} differs from "
            f"gemma2.rope.freq_base={common['rope_theta']}; vlite's Gemma 2 rotates every "
            "layer with one base"
        )
    window = _sliding_window(gguf_file, defaults["attention.sliding_window"])
    return {
        **_gemma_fields(gguf_file, common, window),
        "attn_logit_softcapping": _soft_cap(
            gguf_file, "attn_logit_softcapping", defaults["attn_logit_softcapping"]
        ),
        "final_logit_softcapping": _soft_cap(
            gguf_file, "final_logit_softcapping", defaults["final_logit_softcapping"]
        ),
    }


def _gemma3_fields(gguf_file: GGUFFile, common: dict[str, Any]) -> dict[str, Any]:
    # rope_theta (common) is the global layers' base; the local layers' is never scaled.
    return {
        **_gemma_fields(gguf_file, common, _sliding_window(gguf_file, None)),
        "rope_local_base_freq": float(
            gguf_file.arch_value("rope.freq_base_swa", GEMMA3_LOCAL_ROPE_BASE)
        ),
        "rope_scaling": _gemma3_global_rope_scaling(gguf_file),
        "attn_logit_softcapping": _soft_cap(gguf_file, "attn_logit_softcapping", None),
        "final_logit_softcapping": _soft_cap(gguf_file, "final_logit_softcapping", None),
    }


def _gemma3_global_rope_scaling(gguf_file: GGUFFile) -> dict[str, Any] | None:
    """``rope.scaling.type`` linear (checked by :func:`_check_rope_scaling`) with its
    ``rope.scaling.factor``, or None."""
    if gguf_file.arch_value("rope.scaling.type", "none") == "none":
        return None
    return {"rope_type": "linear", "factor": float(gguf_file.arch_value("rope.scaling.factor"))}


#: Hugging Face architecture -> its builder: ``(file, the common fields) -> its own fields``.
_FIELD_BUILDERS = {
    "LlamaForCausalLM": _llama_fields,
    "Qwen2ForCausalLM": _qwen2_fields,
    "Qwen3ForCausalLM": _qwen3_fields,
    "SmolLM3ForCausalLM": _smollm3_fields,
    "Phi3ForCausalLM": _phi3_fields,
    "MixtralForCausalLM": _mixtral_fields,
    "Qwen2MoeForCausalLM": _qwen2moe_fields,
    "Qwen3MoeForCausalLM": _qwen3moe_fields,
    "OlmoeForCausalLM": _olmoe_fields,
    "Gemma2ForCausalLM": _gemma2_fields,
    "Gemma3ForCausalLM": _gemma3_fields,
}
