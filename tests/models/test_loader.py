"""Safetensors iteration, model building, dtype handling and dummy weights."""

from __future__ import annotations

import re

import pytest
import torch
from transformers import AutoModelForCausalLM

from vlite.core.attention import AttentionMetadata
from vlite.models.llama import LlamaForCausalLM
from vlite.models.loader import build_model, iter_safetensors_weights, load_hf_config
from vlite.plugins.attention.torch_ref import TorchAttentionBackend
from vlite.testing.tiny_models import make_tiny_model


def _build(folder, **kw):
    options = {"block_size": 16, "dtype": torch.float32, "device": "cpu", "folder": folder}
    options.update(kw)
    return build_model(load_hf_config(folder), LlamaForCausalLM, TorchAttentionBackend, **options)


def _prefill_logits(model, token_ids):
    n = len(token_ids)
    caches = [torch.zeros(model.attention.kv_cache_shape(4)) for _ in range(model.num_layers)]
    metadata = AttentionMetadata(
        slot_mapping=torch.arange(n),
        query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        seq_lens=torch.tensor([n], dtype=torch.int32),
        block_tables=torch.arange(4, dtype=torch.int32)[None],
        max_query_len=n,
        max_seq_len=n,
        query_lens_cpu=[n],
        seq_lens_cpu=[n],
    )
    hidden = model(torch.tensor(token_ids), torch.arange(n), caches, metadata)
    return model.compute_logits(hidden)


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), "Qwen3ForCausalLM")


def test_sharded_checkpoint_is_read_through_its_index(tmp_path, tiny_folder):
    hf_model = AutoModelForCausalLM.from_pretrained(tiny_folder, dtype=torch.float32)
    hf_model.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1

    weights = dict(iter_safetensors_weights(tmp_path))

    expected = hf_model.state_dict()
    expected.pop("lm_head.weight", None)  # tied: not stored
    assert sorted(weights) == sorted(expected)
    for name, tensor in expected.items():
        torch.testing.assert_close(weights[name], tensor, rtol=0, atol=0)


def test_missing_safetensors_names_the_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match=re.escape(str(tmp_path))):
        list(iter_safetensors_weights(tmp_path))


def test_unknown_load_format_is_an_error(tiny_folder):
    with pytest.raises(ValueError, match="load_format"):
        _build(tiny_folder, load_format="gguf-ish")


def test_built_model_is_frozen_eval_and_in_dtype(tiny_folder):
    before = torch.get_default_dtype()
    model = _build(tiny_folder, dtype=torch.bfloat16)
    assert torch.get_default_dtype() == before
    assert not model.training
    params = list(model.parameters())
    assert all(p.dtype == torch.bfloat16 and not p.requires_grad for p in params)
    assert model.rotary_emb.cos_cache.dtype == torch.float32  # kept precise, cast on use
    with torch.no_grad():
        logits = _prefill_logits(model, [5, 6, 7, 8])
    assert logits.dtype == torch.float32
    fp32 = _build(tiny_folder)
    with torch.no_grad():
        reference = _prefill_logits(fp32, [5, 6, 7, 8])
    torch.testing.assert_close(logits, reference, atol=0.15, rtol=0.05)


def test_dummy_weights_are_deterministic_and_read_no_file(tiny_folder):
    config = load_hf_config(tiny_folder)

    def build():
        return build_model(
            config,
            LlamaForCausalLM,
            TorchAttentionBackend,
            block_size=16,
            dtype=torch.float32,
            device="cpu",
            load_format="dummy",
        )

    first, second = build(), build()
    for (name, a), (_, b) in zip(
        first.state_dict().items(), second.state_dict().items(), strict=True
    ):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
    with torch.no_grad():
        logits = _prefill_logits(first, [5, 6, 7, 8, 9])
    assert torch.isfinite(logits).all()
    assert logits.std() > 0.01
    assert logits.abs().max() < 100
