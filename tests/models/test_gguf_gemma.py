"""GGUF files of Gemma 2 and Gemma 3 (text).

Each tiny random Hugging Face model is written as llama.cpp's converter would write it
(:mod:`vlite.testing.tiny_gguf`: every norm weight plus 1, the sandwich norms' names, no
query scale, no layer pattern) and checked against the folder it came from: the config,
every weight, greedy tokens and log-probabilities against transformers; transformers' own
GGUF loader must read the tiny file to the same weights (it subtracts the 1 too), so the
files are not written with the loader's own misunderstanding.

What the format leaves to llama.cpp is tested on metadata-only files: the query scale from
the model size (27B: ``hidden // heads``), the layer pattern, Gemma 3's local RoPE base and
its linear scaling, Gemma 2's defaults. (Which files have permuted Q/K rows, gemma2 and
gemma3 included: ``test_gguf_architectures.py``.)
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
from vlite.models.gemma import GemmaRMSNorm
from vlite.models.gguf import dequantize_tensor, gguf_hf_config, iter_gguf_weights, read_gguf
from vlite.models.gguf_names import hf_weight_name
from vlite.models.rope import rope_parameters_from_config
from vlite.models.spec import layer_sliding_windows
from vlite.testing.tiny_gguf import write_tiny_gguf
from vlite.testing.tiny_models import make_tiny_model

#: case -> (architecture, make_tiny_model overrides). The overrides make each model one the
#: format can describe: query_pre_attn_scalar = head_dim (what llama.cpp derives for every
#: size but 27B), Gemma 3 with six layers, five local then one global (llama.cpp's fixed
#: pattern; the tiny default of one local and one global layer is not expressible).
CASES = {
    "gemma2": ("Gemma2ForCausalLM", {"head_dim": 16, "query_pre_attn_scalar": 16}),
    "gemma3": (
        "Gemma3ForCausalLM",
        {
            "head_dim": 32,
            "query_pre_attn_scalar": 32,
            "num_hidden_layers": 6,
            "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
        },
    ),
}

CONFIG_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
    "tie_word_embeddings",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "hidden_activation",
    "query_pre_attn_scalar",
    "sliding_window",
    "layer_types",
    "attn_logit_softcapping",
    "final_logit_softcapping",
    "rope_parameters",
)

#: Prompts shorter and longer than the tiny models' 12-token window.
PROMPTS = [
    "Tell me a joke.",
    "The engine schedules requests from many users at once",
    "1 2 3 4 5 6 7 8 9 10 11 12",
]


def make_tiny_gguf(root: Path, case: str) -> tuple[Path, Path]:
    """``(Hugging Face folder, GGUF file converted from it)`` for one of :data:`CASES`."""
    architecture, overrides = CASES[case]
    folder = make_tiny_model(
        root / "hf", architecture, num_kv_heads=2, tie_word_embeddings=True, **overrides
    )
    return folder, write_tiny_gguf(folder, root / f"{case}.gguf")


@pytest.fixture(scope="module", params=sorted(CASES))
def tiny_gguf(request, tmp_path_factory) -> tuple[Path, Path]:
    return make_tiny_gguf(tmp_path_factory.mktemp(request.param), request.param)


def checkpoint(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(folder / "model.safetensors")


def as_stored(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """The checkpoint's tensor as a float32 file can give it back: a norm weight went in
    plus 1 (rounded to float32, losing the last bit of about half the values) and comes out
    minus 1; every other tensor is exact."""
    return (tensor + 1) - 1 if name.endswith("norm.weight") else tensor


# ---- config, weights, tokens ----------------------------------------------------------------


def test_config_from_metadata_matches_the_checkpoint(tiny_gguf):
    folder, path = tiny_gguf
    expected = AutoConfig.from_pretrained(folder)
    config = gguf_hf_config(read_gguf(path))
    assert type(config) is type(expected)
    assert config.architectures == expected.architectures
    for field in CONFIG_FIELDS:
        assert getattr(config, field) == getattr(expected, field), field
    assert config.rms_norm_eps == pytest.approx(expected.rms_norm_eps)
    assert layer_sliding_windows(config) == layer_sliding_windows(expected)
    for layer_type in ("sliding_attention", "full_attention"):
        got = rope_parameters_from_config(config, layer_type)
        assert got == rope_parameters_from_config(expected, layer_type), layer_type


def test_weights_equal_the_checkpoint(tiny_gguf):
    folder, path = tiny_gguf
    expected = checkpoint(folder)
    weights = dict(iter_gguf_weights(path, show_progress=False))
    assert sorted(weights) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(weights[name], as_stored(name, tensor)), name
        assert torch.allclose(weights[name], tensor, rtol=0, atol=2**-22), name


def test_greedy_tokens_and_logprobs_from_a_gguf_file_match_transformers(tiny_gguf):
    """Greedy tokens, and every step's top log-probabilities (a random tiny model repeats
    tokens; the log-probabilities see what an argmax does not)."""
    folder, path = tiny_gguf
    hf_model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    hf_model.generation_config.eos_token_id = None
    hf_tokenizer = AutoTokenizer.from_pretrained(folder)
    assert any(len(hf_tokenizer.encode(p)) > hf_model.config.sliding_window for p in PROMPTS)

    # The cache in float32 too: float16 (the GGUF default) rounds keys where transformers
    # does not.
    llm = LLM(model=str(path), dtype="float32", num_kv_blocks=32, kv_cache_dtype="float32")
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=3)
    outputs = llm.generate(PROMPTS, params, use_tqdm=False)

    for prompt, output in zip(PROMPTS, outputs, strict=True):
        ids = hf_tokenizer.encode(prompt)
        assert output.prompt_token_ids == ids
        with torch.no_grad():
            expected = hf_model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)
            logits = hf_model(expected).logits[0, len(ids) - 1 : -1]
        tokens = output.outputs[0].token_ids
        assert tokens == expected[0, len(ids) :].tolist(), prompt
        hf_logprobs = torch.log_softmax(logits.float(), dim=-1)
        for step, top in enumerate(output.outputs[0].logprobs):
            for token_id, entry in top.items():
                assert entry.logprob == pytest.approx(
                    hf_logprobs[step, token_id].item(), abs=1e-4
                ), (prompt, step)


@pytest.fixture(scope="module", params=sorted(CASES))
def quantized_gemma(request, tmp_path_factory) -> Path:
    """A tiny Gemma 2 or 3 GGUF file with Q8_0 matrices (the C kernels' path)."""
    root = tmp_path_factory.mktemp(f"quantized-{request.param}")
    architecture, overrides = CASES[request.param]
    folder = make_tiny_model(
        root / "hf", architecture, num_kv_heads=2, tie_word_embeddings=True, **overrides
    )
    return write_tiny_gguf(folder, root / "q8.gguf", quantize=("Q8_0", "Q8_0"))


def _greedy_with_logprobs(llm: LLM):
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=3)
    return [o.outputs[0] for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def test_the_c_kernels_compute_what_pytorchs_ops_compute_on_the_same_weights(quantized_gemma):
    """Quantized weights run the norms (1 + w), q/k norms, RoPE, GeGLU and the embedding
    scale as C calls; dequantized (``quantization="none"``), the same values go through
    PyTorch's ops. Tokens are equal and log-probabilities agree to float32 rounding (with
    float32 activations: quantized ones round more)."""
    fused = LLM(
        model=str(quantized_gemma),
        num_kv_blocks=32,
        enforce_eager=True,
        quantized_activations="off",
        kv_cache_dtype="float32",  # float16 would round the two paths' keys apart
    )
    model = fused.llm_engine.engine_core.executor.worker.runner.model
    assert model.native_ops is not None
    norms = [module for module in model.modules() if isinstance(module, GemmaRMSNorm)]
    assert norms and all(norm.native is not None for norm in norms)
    expected = _greedy_with_logprobs(fused)
    del fused
    plain = LLM(
        model=str(quantized_gemma),
        num_kv_blocks=32,
        quantization="none",
        kv_cache_dtype="float32",
    )
    assert plain.llm_engine.engine_core.executor.worker.runner.model.native_ops is None
    for got, want in zip(_greedy_with_logprobs(plain), expected, strict=True):
        assert got.token_ids == want.token_ids
        for top, top_expected in zip(got.logprobs, want.logprobs, strict=True):
            for token_id, entry in top_expected.items():
                assert top[token_id].logprob == pytest.approx(entry.logprob, abs=1e-4)


def test_quantized_gemma3_decode_steps_are_replayed_with_the_eager_tokens(
    tmp_path, capsys, replayed_decode_sizes
):
    architecture, overrides = CASES["gemma3"]
    folder = make_tiny_model(
        tmp_path / "hf", architecture, num_kv_heads=2, tie_word_embeddings=True, **overrides
    )
    path = str(write_tiny_gguf(folder, tmp_path / "q8.gguf", quantize=("Q8_0", "Q8_0")))
    eager = _greedy_with_logprobs(LLM(model=path, num_kv_blocks=32, enforce_eager=True))
    capsys.readouterr()
    replayed = LLM(model=path, num_kv_blocks=32)
    largest = len(replayed_decode_sizes("Q8_0"))
    assert f"CPU step replay: {largest} decode batch sizes (1-{largest})" in (
        capsys.readouterr().err
    )
    outputs = _greedy_with_logprobs(replayed)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in eager]
    assert [o.logprobs for o in outputs] == [o.logprobs for o in eager]


@pytest.mark.parametrize("case", sorted(CASES))
def test_transformers_reads_the_tiny_file_to_the_same_weights(tmp_path, case):
    """transformers' own GGUF loader (its names, its minus 1 on Gemma norms, no Q/K
    permutation) reads the file to the checkpoint, exactly as vlite does."""
    folder, path = make_tiny_gguf(tmp_path, case)
    from_gguf = AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file=path.name, dtype=torch.float32
    ).state_dict()
    from_folder = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).state_dict()
    assert sorted(from_gguf) == sorted(from_folder)
    for name, tensor in from_folder.items():
        assert torch.equal(from_gguf[name], as_stored(name, tensor)), name
    weights = dict(iter_gguf_weights(path, show_progress=False))  # and vlite's reading
    assert all(torch.equal(weights[name], from_gguf[name]) for name in weights)


def _llama_cpp_rms_norm(x: torch.Tensor, stored: torch.Tensor, eps: float) -> torch.Tensor:
    """llama.cpp's RMSNorm: normalise, then scale by the weight as stored in the file."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * stored


def test_loaded_norms_compute_what_llama_cpp_computes_with_the_file_weights(tiny_gguf):
    """The convention itself: vlite's Gemma norm (``1 + weight``) on the loaded weight equals
    llama.cpp's norm on the file's weight, for every norm tensor; the unshifted file weight
    does not."""
    _, path = tiny_gguf
    gguf_file = read_gguf(path)
    architecture = gguf_hf_config(gguf_file).architectures[0]
    eps = float(gguf_file.arch_value("attention.layer_norm_rms_epsilon"))
    weights = dict(iter_gguf_weights(path, show_progress=False))
    generator = torch.Generator().manual_seed(0)
    norms = [t for t in gguf_file.tensors if t.name.endswith("norm.weight")]
    per_layer = 6 if architecture == "Gemma3ForCausalLM" else 4  # Gemma 3: q/k norms too
    assert len(norms) == per_layer * int(gguf_file.arch_value("block_count")) + 1
    for tensor in norms:
        stored = dequantize_tensor(tensor)
        x = torch.randn(5, stored.shape[0], generator=generator)
        llama_cpp = _llama_cpp_rms_norm(x, stored, eps)
        norm = GemmaRMSNorm(stored.shape[0], eps)
        with torch.no_grad():
            norm.weight.copy_(weights[hf_weight_name(tensor.name, architecture)])
            torch.testing.assert_close(norm(x), llama_cpp)
            norm.weight.copy_(stored)
            assert not torch.allclose(norm(x), llama_cpp)


# ---- what llama.cpp fixes and the metadata does not say ------------------------------------


def write_metadata_only_gguf(path: Path, architecture: str, metadata: dict) -> Path:
    """A GGUF file of a small Gemma config's metadata (plus ``metadata``: ints, floats,
    strings or lists of bools) and one zero embedding."""
    writer = gguf.GGUFWriter(str(path), architecture)
    base = {
        "block_count": 2,
        "context_length": 64,
        "embedding_length": 48,
        "feed_forward_length": 32,
        "attention.head_count": 4,
        "attention.head_count_kv": 2,
        "attention.key_length": 16,
        "attention.value_length": 16,
        "attention.layer_norm_rms_epsilon": 1e-6,
    }
    for key, value in {**base, **metadata}.items():
        full_key = f"{architecture}.{key}"
        if isinstance(value, list):
            writer.add_array(full_key, value)
        elif isinstance(value, str):
            writer.add_string(full_key, value)
        elif isinstance(value, float):
            writer.add_float32(full_key, value)
        else:
            writer.add_uint32(full_key, value)
    writer.add_tensor("token_embd.weight", np.zeros((4, 48), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def config_from(tmp_path: Path, architecture: str, **metadata):
    path = write_metadata_only_gguf(tmp_path / f"{architecture}.gguf", architecture, metadata)
    return gguf_hf_config(read_gguf(path))


@pytest.mark.parametrize(
    ("architecture", "layers_27b", "layers_other"), [("gemma2", 46, 42), ("gemma3", 62, 48)]
)
def test_the_query_scale_is_llama_cpps_hidden_per_head_for_27b_else_head_dim(
    tmp_path, architecture, layers_27b, layers_other
):
    """27B (told by its layer count): hidden 48 // 4 heads = 12; any other size: head_dim 16."""
    config = config_from(tmp_path, architecture, block_count=layers_27b)
    assert config.query_pre_attn_scalar == 12
    config = config_from(tmp_path, architecture, block_count=layers_other)
    assert config.query_pre_attn_scalar == 16
    with pytest.raises(NotImplementedError, match=rf"{architecture}\.attention\.scale="):
        config_from(tmp_path, architecture, **{"attention.scale": 0.25})


def test_gemma2_alternates_local_and_global_with_llama_cpps_defaults(tmp_path):
    config = config_from(tmp_path, "gemma2", block_count=4)
    assert config.layer_types == ["sliding_attention", "full_attention"] * 2
    assert layer_sliding_windows(config) == (4096, None, 4096, None)
    assert (config.attn_logit_softcapping, config.final_logit_softcapping) == (50.0, 30.0)
    assert rope_parameters_from_config(config, "sliding_attention").rope_theta == 10000.0
    with pytest.raises(NotImplementedError, match="gemma2.rope.freq_base_swa=20000"):
        config_from(tmp_path, "gemma2", **{"rope.freq_base_swa": 20000.0})
    with pytest.raises(NotImplementedError, match="RoPE scaling 'linear'"):
        config_from(tmp_path, "gemma2", **{"rope.scaling.type": "linear"})


def test_gemma3_has_one_global_layer_in_six_with_a_10000_local_rope_base(tmp_path):
    metadata = {
        "block_count": 12,
        "attention.sliding_window": 512,
        "rope.freq_base": 1e6,
        "rope.scaling.type": "linear",
        "rope.scaling.factor": 8.0,
    }
    config = config_from(tmp_path, "gemma3", **metadata)
    windows = layer_sliding_windows(config)
    assert windows == ((512,) * 5 + (None,)) * 2
    local = rope_parameters_from_config(config, "sliding_attention")
    assert (local.rope_theta, local.rope_type) == (10000.0, "default")
    glob = rope_parameters_from_config(config, "full_attention")
    assert (glob.rope_theta, glob.rope_type, glob.scaling) == (1e6, "linear", {"factor": 8.0})
    assert config.attn_logit_softcapping is None and config.final_logit_softcapping is None


def test_gemma3_reads_a_local_rope_base_layer_pattern_and_final_cap_the_file_states(tmp_path):
    """Today's converter writes the local base (rope.freq_base_swa); a pattern is a list of
    bools (true: local) or a period (the last layer of each run global)."""
    stated = {
        "attention.sliding_window": 8,
        "rope.freq_base_swa": 20000.0,
        "attention.sliding_window_pattern": [True, False, False, True],
        "final_logit_softcapping": 30.0,
    }
    config = config_from(tmp_path, "gemma3", block_count=4, **stated)
    assert layer_sliding_windows(config) == (8, None, None, 8)
    assert rope_parameters_from_config(config, "sliding_attention").rope_theta == 20000.0
    assert config.final_logit_softcapping == 30.0
    period = {"attention.sliding_window": 8, "attention.sliding_window_pattern": 2}
    config = config_from(tmp_path, "gemma3", block_count=4, **period)
    assert layer_sliding_windows(config) == (8, None, 8, None)


def test_gemma3_without_a_sliding_window_is_global_everywhere(tmp_path):
    """llama.cpp: no (or a zero) ``attention.sliding_window``, no local layers."""
    for window in ({}, {"attention.sliding_window": 0}):
        config = config_from(tmp_path, "gemma3", block_count=6, **window)
        assert config.layer_types == ["full_attention"] * 6
        assert layer_sliding_windows(config) == (None,) * 6


def test_gemma3_rope_scaling_other_than_linear_or_without_a_factor_is_refused(tmp_path):
    with pytest.raises(NotImplementedError, match="RoPE scaling 'yarn'.*supported: none, linear"):
        config_from(tmp_path, "gemma3", **{"rope.scaling.type": "yarn"})
    with pytest.raises(ValueError, match="'gemma3.rope.scaling.factor'"):
        config_from(tmp_path, "gemma3", **{"rope.scaling.type": "linear"})
    with pytest.raises(ValueError, match="sliding_window_pattern lists 3 layers"):
        config_from(
            tmp_path,
            "gemma3",
            **{"attention.sliding_window": 8, "attention.sliding_window_pattern": [True] * 3},
        )
