"""GGUF files of Phi-3, Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE and SmolLM3.

Each tiny random Hugging Face model is written as llama.cpp's converter would write it
(:mod:`vlite.testing.tiny_gguf`: its names, stacked experts, Q/K permutation and metadata)
and checked against the folder it came from: the config, every weight, and greedy tokens
against transformers. Where transformers reads an architecture's GGUF files itself (phi3,
qwen2moe, qwen3moe) it must read the tiny file to the checkpoint too, so the files are not
written with the loader's own misunderstanding. Which architectures have permuted Q/K rows
follows from how llama.cpp rotates each one (tested below from its RoPE style table).
(Gemma 2 and Gemma 3 files: ``test_gguf_gemma.py``.)
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from vlite import LLM, SamplingParams
from vlite.models.gguf import (
    PERMUTED_QK_ARCHITECTURES,
    gguf_hf_config,
    iter_gguf_weights,
    load_gguf_tokenizer,
    permute_qk,
    read_gguf,
    unpermute_qk,
)
from vlite.models.gguf_config import GGUF_ARCHITECTURES
from vlite.models.quantization import BlockQuantizedTensor
from vlite.models.spec import head_dim_of
from vlite.testing.tiny_gguf import GGUF_ARCHITECTURE, OLMOE_RMS_EPS, PERMUTED_QK, write_tiny_gguf
from vlite.testing.tiny_models import make_tiny_model

#: case -> (architecture, make_tiny_model overrides). The overrides make each model one the
#: format can describe: every Qwen2-MoE layer a mixture (gguf-py has no dense FFN tensors
#: for qwen2moe), OLMoE with the converter's fixed epsilon and no clip_qkv (not written),
#: SmolLM3 with llama.cpp's fixed no-RoPE step of 4 (not written either).
CASES = {
    "phi3": ("Phi3ForCausalLM", {}),
    "mixtral": ("MixtralForCausalLM", {}),
    "qwen2moe": ("Qwen2MoeForCausalLM", {"mlp_only_layers": []}),
    "qwen3moe": ("Qwen3MoeForCausalLM", {}),
    "olmoe": ("OlmoeForCausalLM", {"rms_norm_eps": OLMOE_RMS_EPS, "clip_qkv": None}),
    "smollm3": ("SmolLM3ForCausalLM", {"num_hidden_layers": 4, "no_rope_layer_interval": 4}),
}

COMMON_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "max_position_embeddings",
    "tie_word_embeddings",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "hidden_act",
)
ARCHITECTURE_FIELDS = {
    "Phi3ForCausalLM": ("sliding_window", "original_max_position_embeddings"),
    "MixtralForCausalLM": ("num_local_experts", "num_experts_per_tok", "sliding_window"),
    "Qwen2MoeForCausalLM": (
        "num_experts",
        "num_experts_per_tok",
        "moe_intermediate_size",
        "shared_expert_intermediate_size",
        "norm_topk_prob",
        "mlp_only_layers",
        "decoder_sparse_step",
    ),
    "Qwen3MoeForCausalLM": (
        "num_experts",
        "num_experts_per_tok",
        "moe_intermediate_size",
        "norm_topk_prob",
        "mlp_only_layers",
        "decoder_sparse_step",
    ),
    "OlmoeForCausalLM": ("num_experts", "num_experts_per_tok", "norm_topk_prob", "clip_qkv"),
    "SmolLM3ForCausalLM": ("no_rope_layers", "use_sliding_window"),
}


def make_tiny_gguf(
    root: Path, case: str, model_overrides: dict | None = None, **writer_options
) -> tuple[Path, Path]:
    """``(Hugging Face folder, GGUF file converted from it)`` for one of :data:`CASES`
    (``model_overrides`` changes the tiny model's config further)."""
    architecture, overrides = CASES[case]
    overrides = {**overrides, **(model_overrides or {})}
    folder = make_tiny_model(
        root / "hf", architecture, num_kv_heads=2, tie_word_embeddings=False, **overrides
    )
    return folder, write_tiny_gguf(folder, root / f"{case}.gguf", **writer_options)


@pytest.fixture(scope="module", params=sorted(CASES))
def tiny_gguf(request, tmp_path_factory) -> tuple[Path, Path]:
    return make_tiny_gguf(tmp_path_factory.mktemp(request.param), request.param)


def checkpoint(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(folder / "model.safetensors")


# ---- config, weights, tokens ----------------------------------------------------------------


def test_config_from_metadata_matches_the_checkpoint(tiny_gguf):
    folder, path = tiny_gguf
    expected = AutoConfig.from_pretrained(folder)
    config = gguf_hf_config(read_gguf(path))
    assert type(config) is type(expected)
    assert config.architectures == expected.architectures
    for field in COMMON_FIELDS + ARCHITECTURE_FIELDS[expected.architectures[0]]:
        assert getattr(config, field) == getattr(expected, field), field
    assert config.rms_norm_eps == pytest.approx(expected.rms_norm_eps)
    assert config.rope_parameters == expected.rope_parameters  # incl. partial_rotary_factor
    assert head_dim_of(config) == head_dim_of(expected)


def test_weights_equal_the_checkpoint(tiny_gguf):
    folder, path = tiny_gguf
    expected = checkpoint(folder)
    weights = dict(iter_gguf_weights(path, show_progress=False))
    assert sorted(weights) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(weights[name], tensor), name


def test_greedy_tokens_from_a_gguf_file_match_transformers(tiny_gguf):
    folder, path = tiny_gguf
    prompts = ["Tell me a joke.", "The engine schedules requests", "1 2 3"]
    hf_model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    hf_model.generation_config.eos_token_id = None
    hf_tokenizer = AutoTokenizer.from_pretrained(folder)

    llm = LLM(model=str(path), dtype="float32", num_kv_blocks=32)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)

    for prompt, output in zip(prompts, outputs, strict=True):
        ids = hf_tokenizer.encode(prompt)
        assert output.prompt_token_ids == ids
        with torch.no_grad():
            expected = hf_model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)
        assert output.outputs[0].token_ids == expected[0, len(ids) :].tolist(), prompt


def test_tokenizer_and_chat_template_come_from_the_file(tiny_gguf):
    folder, path = tiny_gguf
    expected = AutoTokenizer.from_pretrained(folder)
    tokenizer = load_gguf_tokenizer(path)
    text = "Hello, world! The quick brown fox jumps over the lazy dog. </s> 42"
    assert tokenizer.encode(text) == expected.encode(text)
    messages = [{"role": "user", "content": "Tell me a joke."}]
    assert tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    ) == expected.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


@pytest.mark.parametrize("case", ["phi3", "qwen2moe", "qwen3moe"])
def test_transformers_reads_the_tiny_file_to_the_same_weights(tmp_path, case):
    """transformers' own GGUF loader (names, expert stacking, fused Phi-3 matrices, the
    squeezed shared-expert gate) reads the file to the checkpoint, as vlite does.
    (Its qwen2moe/qwen3moe metadata mapping has no expert width: the folder's config is
    given for those.)"""
    folder, path = make_tiny_gguf(tmp_path, case)
    config = {} if case == "phi3" else {"config": AutoConfig.from_pretrained(folder)}
    from_gguf = AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file=path.name, dtype=torch.float32, **config
    ).state_dict()
    from_folder = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).state_dict()
    assert sorted(from_gguf) == sorted(from_folder)
    for name, tensor in from_folder.items():
        assert torch.equal(from_gguf[name], tensor), name
    weights = dict(iter_gguf_weights(path, show_progress=False))  # and vlite's reading
    assert all(torch.equal(weights[n], t) for n, t in checkpoint(folder).items())


# ---- which files have permuted Q/K rows --------------------------------------------------------

#: How llama.cpp rotates each architecture (its RoPE type per architecture): "adjacent"
#: pairs (x[2i], x[2i+1]) for llama and smollm3, "half" (x[i], x[i + n_rot/2], as Hugging
#: Face) for the others, Gemma's included. Phi-3 rotates the first half of each head only
#: (rope dims 8 of 16).
LLAMA_CPP_ROPE = {
    "llama": ("adjacent", 1.0),
    "smollm3": ("adjacent", 1.0),
    "qwen2": ("half", 1.0),
    "qwen3": ("half", 1.0),
    "qwen2moe": ("half", 1.0),
    "qwen3moe": ("half", 1.0),
    "olmoe": ("half", 1.0),
    "phi3": ("half", 0.5),
    "gemma2": ("half", 1.0),
    "gemma3": ("half", 1.0),
}


def _rope(x: torch.Tensor, positions: torch.Tensor, style: str, fraction: float):
    head_dim = x.shape[-1]
    rotary = int(head_dim * fraction)
    inv_freq = 10000.0 ** (-torch.arange(0, rotary, 2, dtype=torch.float64) / rotary)
    angles = torch.outer(positions, inv_freq)[:, None, :]
    cos, sin = angles.cos(), angles.sin()
    rotated, rest = x[..., :rotary], x[..., rotary:]
    if style == "half":
        a, b = rotated.chunk(2, dim=-1)
        rotated = torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)
    else:
        a, b = rotated[..., 0::2], rotated[..., 1::2]
        rotated = torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)
    return torch.cat((rotated, rest), dim=-1)


@pytest.mark.parametrize("architecture", sorted(LLAMA_CPP_ROPE))
def test_the_loader_unpermutes_exactly_the_files_llama_cpp_rotates_in_adjacent_pairs(
    architecture,
):
    """A file's Q/K rows are the layout on which llama.cpp's rotation gives Hugging Face's
    attention scores; vlite's loader must turn exactly that layout back into HF's rows."""
    generator = torch.Generator().manual_seed(0)
    num_heads, head_dim, hidden, num_tokens = 3, 16, 12, 6
    w_q, w_k = (
        torch.randn(num_heads * head_dim, hidden, generator=generator, dtype=torch.float64)
        for _ in range(2)
    )
    x = torch.randn(num_tokens, hidden, generator=generator, dtype=torch.float64)
    positions = torch.arange(num_tokens, dtype=torch.float64)
    style, fraction = LLAMA_CPP_ROPE[architecture]

    def scores(w_q, w_k, style):
        q, k = ((x @ w.T).view(num_tokens, num_heads, head_dim) for w in (w_q, w_k))
        q, k = (_rope(t, positions, style, fraction) for t in (q, k))
        return torch.einsum("qhd,khd->hqk", q, k)

    hf_scores = scores(w_q, w_k, "half")
    layouts = {"as is": lambda w: w, "permuted": lambda w: permute_qk(w, num_heads)}
    fitting = [
        layout
        for layout, lay_out in layouts.items()
        if torch.allclose(scores(lay_out(w_q), lay_out(w_k), style), hf_scores)
    ]
    assert len(fitting) == 1  # exactly one layout works under llama.cpp's rotation
    file_rows = layouts[fitting[0]](w_q)
    loaded = (
        unpermute_qk(file_rows, num_heads)
        if architecture in PERMUTED_QK_ARCHITECTURES
        else file_rows
    )
    assert torch.equal(loaded, w_q)


def test_the_test_writer_permutes_the_architectures_the_loader_unpermutes():
    assert {GGUF_ARCHITECTURE[a] for a in PERMUTED_QK} == PERMUTED_QK_ARCHITECTURES
    assert set(LLAMA_CPP_ROPE) == set(GGUF_ARCHITECTURES)


# ---- expert tensors: per-expert files, f16, block-quantized ----------------------------------


def test_mixtral_files_with_one_tensor_per_expert_load_the_same(tmp_path):
    folder, path = make_tiny_gguf(tmp_path, "mixtral", stacked_experts=False)
    names = read_gguf(path).tensor_names
    assert "blk.1.ffn_down.3.weight" in names and "blk.1.ffn_down_exps.weight" not in names
    weights = dict(iter_gguf_weights(path, show_progress=False))
    expected = checkpoint(folder)
    assert sorted(weights) == sorted(expected)
    assert all(torch.equal(weights[name], tensor) for name, tensor in expected.items())


def test_f16_stacked_experts_load_as_the_checkpoint_rounded_to_f16(tmp_path):
    folder, path = make_tiny_gguf(tmp_path, "mixtral", float_type="F16")
    gguf_file = read_gguf(path)
    assert gguf_file.hf_shape("blk.0.ffn_gate_exps.weight") == (4, 128, 64)
    types = {t.name: t.tensor_type.name for t in gguf_file.tensors}
    assert types["blk.0.ffn_gate_exps.weight"] == "F16" and types["blk.0.attn_norm.weight"] == "F32"
    weights = dict(iter_gguf_weights(path, show_progress=False))
    for name, tensor in checkpoint(folder).items():
        expected = tensor.half().float() if tensor.dim() > 1 else tensor  # vectors stay F32
        assert torch.equal(weights[name], expected), name


def test_quantized_experts_stay_quantized_and_run_like_transformers(tmp_path):
    """Q8_0 everywhere: dense matrices and every expert's matrix stay block-quantized when
    asked (an expert's rows of the stacked tensor, exactly the file's values); the default
    quantization='auto' keeps the experts in FusedMoE, and its greedy tokens equal
    transformers' on the same file."""
    folder, path = make_tiny_gguf(tmp_path, "qwen3moe", quantize=("Q8_0", "Q8_0"))
    weights = dict(iter_gguf_weights(path, keep_types=frozenset({"Q8_0"}), show_progress=False))
    assert isinstance(weights["model.layers.0.self_attn.q_proj.weight"], BlockQuantizedTensor)
    expert = weights["model.layers.1.mlp.experts.3.down_proj.weight"]
    assert isinstance(expert, BlockQuantizedTensor) and expert.tensor_type == "Q8_0"
    original = checkpoint(folder)["model.layers.1.mlp.experts.3.down_proj.weight"]
    q8 = gguf.quants.quantize(original.numpy(), gguf.GGMLQuantizationType.Q8_0)
    roundtrip = gguf.quants.dequantize(q8, gguf.GGMLQuantizationType.Q8_0)
    assert torch.equal(expert.dequantize(), torch.from_numpy(roundtrip))

    hf_model = AutoModelForCausalLM.from_pretrained(
        tmp_path,
        gguf_file=path.name,
        config=AutoConfig.from_pretrained(folder),
        dtype=torch.float32,
    )
    hf_model.generation_config.eos_token_id = None
    prompts = [[5, 6, 7, 8, 9], list(range(20, 60)), [100, 3]]
    llm = LLM(model=str(path), num_kv_blocks=32)  # quantization="auto"
    model = llm.llm_engine.engine_core.executor.worker.runner.model
    experts = model.model.layers[1].mlp.experts
    assert experts.quantized is not None and experts.w13 is None
    assert experts.quantized.w13.shape == (4, 2 * experts.intermediate_size, 64)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, output in zip(prompts, outputs, strict=True):
        with torch.no_grad():
            expected = hf_model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)
        assert output.outputs[0].token_ids == expected[0, len(prompt) :].tolist()


#: case -> the module of layer 1 whose weight must stay quantized on the quantized path.
QUANTIZED_MODULE = {
    "phi3": "self_attn.qkv_proj",  # fused in the file: cut into q/k/v by the format
    "mixtral": "mlp.experts",
    "qwen2moe": "mlp.experts",
    "qwen3moe": "mlp.experts",
    "olmoe": "mlp.experts",
    "smollm3": "mlp.gate_up_proj",
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_quantized_files_keep_fused_matrices_and_experts_quantized(tmp_path, case):
    """Q8_0 everywhere: Phi-3's fused matrices and the mixtures' experts stay quantized
    (they used to be dequantized), and the greedy tokens equal the float32 path's."""
    # Every width a multiple of Q8_0's 32-value blocks (the tiny Qwen2-MoE's shared expert
    # has 48 features).
    overrides = {"shared_expert_intermediate_size": 64} if case == "qwen2moe" else {}
    _, path = make_tiny_gguf(tmp_path, case, overrides, quantize=("Q8_0", "Q8_0"))
    prompts = [[5, 6, 7, 8, 9], list(range(20, 60)), [100, 3]]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    tokens = {}
    for quantization in ("auto", "none"):
        llm = LLM(model=str(path), quantization=quantization, num_kv_blocks=32)
        model = llm.llm_engine.engine_core.executor.worker.runner.model
        module = model.get_submodule(f"model.layers.1.{QUANTIZED_MODULE[case]}")
        assert (module.quantized is not None) == (quantization == "auto")
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        tokens[quantization] = [o.outputs[0].token_ids for o in outputs]
    assert tokens["auto"] == tokens["none"]


def test_qwen2moe_layers_without_a_router_are_dense(tmp_path):
    """Outside what the converter writes, but exact: a layer with no ffn_gate_inp is dense."""
    folder = make_tiny_model(tmp_path / "hf", "Qwen2MoeForCausalLM", tie_word_embeddings=False)
    path = write_tiny_gguf(folder, tmp_path / "dense-layer.gguf")
    assert gguf_hf_config(read_gguf(path)).mlp_only_layers == [1]
    weights = dict(iter_gguf_weights(path, show_progress=False))
    assert all(torch.equal(weights[name], t) for name, t in checkpoint(folder).items())


# ---- what the metadata must say --------------------------------------------------------------


def write_metadata_only_gguf(
    path: Path, architecture: str, metadata: dict, tensors: tuple[str, ...] = ()
) -> Path:
    """A GGUF file with a small config's metadata (plus ``metadata``) and zero tensors."""
    writer = gguf.GGUFWriter(str(path), architecture)
    base = {
        "block_count": 1,
        "context_length": 64,
        "embedding_length": 16,
        "feed_forward_length": 32,
        "attention.head_count": 2,
        "attention.layer_norm_rms_epsilon": 1e-6,
    }
    for key, value in {**base, **metadata}.items():
        if isinstance(value, float):
            writer.add_float32(f"{architecture}.{key}", value)
        else:
            writer.add_uint32(f"{architecture}.{key}", value)
    for name in ("token_embd.weight", *tensors):
        writer.add_tensor(name, np.zeros((4, 16), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_mixture_without_its_experts_per_token_is_refused_naming_the_key(tmp_path):
    router = ("blk.0.ffn_gate_inp.weight",)
    path = write_metadata_only_gguf(tmp_path / "m.gguf", "qwen3moe", {"expert_count": 4}, router)
    with pytest.raises(ValueError, match="'qwen3moe.expert_used_count'"):
        gguf_hf_config(read_gguf(path))


def test_a_llama_file_with_experts_is_mixtral_and_a_sigmoid_router_is_refused(tmp_path):
    experts = {"expert_count": 4, "expert_used_count": 2, "expert_feed_forward_length": 8}
    router = ("blk.0.ffn_gate_inp.weight",)
    path = write_metadata_only_gguf(tmp_path / "m.gguf", "llama", experts, router)
    assert gguf_hf_config(read_gguf(path)).architectures == ["MixtralForCausalLM"]
    path = write_metadata_only_gguf(
        tmp_path / "s.gguf", "llama", {**experts, "expert_gating_func": 2}, router
    )
    with pytest.raises(NotImplementedError, match="expert_gating_func=2"):
        gguf_hf_config(read_gguf(path))


def test_partial_rotary_outside_phi3_and_longrope_factors_are_refused(tmp_path):
    path = write_metadata_only_gguf(tmp_path / "l.gguf", "llama", {"rope.dimension_count": 4})
    with pytest.raises(NotImplementedError, match="rope.dimension_count=4"):
        gguf_hf_config(read_gguf(path))
    path = write_metadata_only_gguf(
        tmp_path / "p.gguf", "phi3", {}, ("rope_factors_long.weight", "rope_factors_short.weight")
    )
    with pytest.raises(NotImplementedError, match="LongRoPE"):
        gguf_hf_config(read_gguf(path))


def test_olmoe_clamps_qkv_only_when_the_file_says_so(tmp_path):
    experts = {"expert_count": 4, "expert_used_count": 2, "expert_feed_forward_length": 8}
    router = ("blk.0.ffn_gate_inp.weight",)
    path = write_metadata_only_gguf(tmp_path / "o.gguf", "olmoe", experts, router)
    assert gguf_hf_config(read_gguf(path)).clip_qkv is None
    clamped = {**experts, "attention.clamp_kqv": 2.0}
    path = write_metadata_only_gguf(tmp_path / "c.gguf", "olmoe", clamped, router)
    assert gguf_hf_config(read_gguf(path)).clip_qkv == 2.0


def test_the_unsupported_architecture_error_lists_the_supported_ones(tmp_path):
    path = write_metadata_only_gguf(tmp_path / "g.gguf", "gemma", {})  # Gemma 1
    with pytest.raises(ValueError, match="'gemma' is not supported") as info:
        gguf_hf_config(read_gguf(path))
    names = ("llama", "phi3", "qwen2moe", "qwen3moe", "olmoe", "smollm3", "gemma2", "gemma3")
    for name in (*names, "Mixtral"):
        assert name in str(info.value)
