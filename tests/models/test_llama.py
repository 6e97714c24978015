"""vlite's Llama-family decoder against transformers on tiny random models (float32, CPU)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from vlite.core.attention import AttentionMetadata
from vlite.models.llama import ARCHITECTURES, LlamaForCausalLM, register_models
from vlite.models.loader import build_model, load_hf_config
from vlite.plugins.attention.torch_ref import TorchAttentionBackend
from vlite.testing.tiny_models import make_tiny_model

BLOCK_SIZE = 16
NUM_BLOCKS = 16
ATOL = 1e-4

VARIANTS = [
    pytest.param((arch, num_kv_heads, tied), id=f"{arch[:-11]}-{attn}-{tie_id}")
    for arch in ARCHITECTURES
    for num_kv_heads, attn in [(2, "gqa"), (4, "mha")]
    for tied, tie_id in [(True, "tied"), (False, "untied")]
]


class Runner:
    """A vlite model with its KV caches and a transformers twin loaded from the same folder."""

    def __init__(self, folder):
        hf_config = load_hf_config(folder)
        self.model = build_model(
            hf_config,
            LlamaForCausalLM,
            TorchAttentionBackend,
            block_size=BLOCK_SIZE,
            dtype=torch.float32,
            device="cpu",
            load_format="safetensors",
            folder=folder,
        )
        self.hf_model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        self.vocab_size = hf_config.vocab_size
        shape = self.model.attention.kv_cache_shape(NUM_BLOCKS)
        self.kv_caches = [torch.zeros(shape) for _ in range(self.model.num_layers)]

    def step(self, chunks):
        """One flattened forward. ``chunks``: per sequence ``(token_ids, start_pos, blocks)``
        where ``token_ids`` are the new tokens at positions ``start_pos...`` and ``blocks``
        the sequence's block table. Returns the logits of each sequence's new tokens."""
        input_ids, positions, slots, query_lens, seq_lens = [], [], [], [], []
        for token_ids, start, blocks in chunks:
            pos = torch.arange(start, start + len(token_ids))
            table = torch.tensor(blocks)
            input_ids.append(torch.tensor(token_ids))
            positions.append(pos)
            slots.append(table[pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE)
            query_lens.append(len(token_ids))
            seq_lens.append(start + len(token_ids))
        max_blocks = max(len(blocks) for _, _, blocks in chunks)
        block_tables = torch.zeros(len(chunks), max_blocks, dtype=torch.int32)
        for i, (_, _, blocks) in enumerate(chunks):
            block_tables[i, : len(blocks)] = torch.tensor(blocks)
        metadata = AttentionMetadata(
            slot_mapping=torch.cat(slots),
            query_start_loc=torch.tensor([0, *torch.tensor(query_lens).cumsum(0)]).int(),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_tables=block_tables,
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            query_lens_cpu=query_lens,
            seq_lens_cpu=seq_lens,
        )
        with torch.no_grad():
            hidden = self.model(
                torch.cat(input_ids), torch.cat(positions), self.kv_caches, metadata
            )
            logits = self.model.compute_logits(hidden)
        assert logits.dtype == torch.float32
        return list(logits.split(query_lens))

    def hf_logits(self, token_ids):
        """``[len(token_ids), vocab]`` transformers logits of a full sequence."""
        with torch.no_grad():
            return self.hf_model(torch.tensor([token_ids])).logits[0].float()


@pytest.fixture(scope="module", params=VARIANTS)
def runner(request, tmp_path_factory):
    arch, num_kv_heads, tied = request.param
    folder = tmp_path_factory.mktemp("tiny")
    make_tiny_model(folder, arch, num_kv_heads=num_kv_heads, tie_word_embeddings=tied)
    return Runner(folder)


def _prompt(runner, length, seed):
    """Random token ids, avoiding the special tokens (pad, bos, eos, unk: ids 0-3)."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(4, runner.vocab_size, (length,), generator=gen).tolist()


def test_prefill_matches_transformers(runner):
    prompt = _prompt(runner, 37, seed=1)
    (logits,) = runner.step([(prompt, 0, [5, 2, 9])])
    torch.testing.assert_close(logits, runner.hf_logits(prompt), atol=ATOL, rtol=0)


def test_chunked_prefill_then_decode_matches_transformers(runner):
    tokens = _prompt(runner, 37 + 6, seed=2)
    blocks = [11, 3, 7]
    expected = runner.hf_logits(tokens)
    (first,) = runner.step([(tokens[:20], 0, blocks)])
    (second,) = runner.step([(tokens[20:37], 20, blocks)])
    torch.testing.assert_close(first, expected[:20], atol=ATOL, rtol=0)
    torch.testing.assert_close(second, expected[20:37], atol=ATOL, rtol=0)
    for pos in range(37, len(tokens)):
        (decode,) = runner.step([([tokens[pos]], pos, blocks)])
        torch.testing.assert_close(decode[0], expected[pos], atol=ATOL, rtol=0)


def test_flattened_batch_matches_transformers(runner):
    """Three prefills in one forward, then a step mixing two decodes and a prompt chunk."""
    seqs = [_prompt(runner, n, seed=10 + n) for n in (37 + 1, 5 + 6, 23 + 1)]
    prefill_lens = [37, 5, 23]
    block_tables = [[4, 0, 13], [8], [1, 15]]
    expected = [runner.hf_logits(s) for s in seqs]

    outs = runner.step(
        [(s[:n], 0, b) for s, n, b in zip(seqs, prefill_lens, block_tables, strict=True)]
    )
    for out, exp, n in zip(outs, expected, prefill_lens, strict=True):
        torch.testing.assert_close(out, exp[:n], atol=ATOL, rtol=0)

    outs = runner.step(
        [(s[n:], n, b) for s, n, b in zip(seqs, prefill_lens, block_tables, strict=True)]
    )
    assert [len(o) for o in outs] == [1, 6, 1]
    for out, exp, n in zip(outs, expected, prefill_lens, strict=True):
        torch.testing.assert_close(out, exp[n:], atol=ATOL, rtol=0)


def test_greedy_decoding_matches_transformers_generate(runner):
    prompt = _prompt(runner, 9, seed=3)
    num_new = 12
    generated = runner.hf_model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=num_new,
        min_new_tokens=num_new,
        do_sample=False,
    )[0, len(prompt) :].tolist()
    blocks = [6, 14]
    (logits,) = runner.step([(prompt, 0, blocks)])
    tokens = [int(logits[-1].argmax())]
    while len(tokens) < num_new:
        (logits,) = runner.step([(tokens[-1:], len(prompt) + len(tokens) - 1, blocks)])
        tokens.append(int(logits[-1].argmax()))
    assert tokens == generated


def test_llama3_rope_scaling_matches_transformers(tmp_path):
    rope = {
        "rope_type": "llama3",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 128,
    }
    folder = make_tiny_model(tmp_path, "LlamaForCausalLM", rope_parameters=rope)
    runner = Runner(folder)
    prompt = _prompt(runner, 150, seed=4)
    (logits,) = runner.step([(prompt, 0, list(range(10)))])
    torch.testing.assert_close(logits, runner.hf_logits(prompt), atol=ATOL, rtol=0)


def test_register_models_registers_all_architectures():
    registered = {}
    register_models(lambda name, cls: registered.__setitem__(name, cls))
    assert registered == dict.fromkeys(ARCHITECTURES, LlamaForCausalLM)


def _tiny_weights(tmp_path):
    folder = make_tiny_model(tmp_path, "Qwen2ForCausalLM", tie_word_embeddings=False)
    hf_config = load_hf_config(folder)
    hf_model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model = LlamaForCausalLM(hf_config, TorchAttentionBackend, BLOCK_SIZE)
    return model, dict(hf_model.state_dict())


def test_load_weights_rejects_unexpected_name(tmp_path):
    model, weights = _tiny_weights(tmp_path)
    weights["model.layers.0.self_attn.extra_proj.weight"] = torch.zeros(1)
    with pytest.raises(ValueError, match=r"unexpected weight 'model\.layers\.0\.self_attn\.extra"):
        model.load_weights(weights.items())


def test_load_weights_rejects_missing_shard(tmp_path):
    model, weights = _tiny_weights(tmp_path)
    del weights["model.layers.1.self_attn.k_proj.bias"]
    with pytest.raises(ValueError, match=r"missing weights: model\.layers\.1\.self_attn\.qkv"):
        model.load_weights(weights.items())


def test_load_weights_rejects_shape_mismatch(tmp_path):
    model, weights = _tiny_weights(tmp_path)
    weights["model.norm.weight"] = torch.ones(3)
    with pytest.raises(ValueError, match=r"model\.norm\.weight.*shape"):
        model.load_weights(weights.items())


def test_qwen2_sliding_layers_get_their_window(tmp_path):
    folder = make_tiny_model(
        tmp_path,
        "Qwen2ForCausalLM",
        use_sliding_window=True,
        sliding_window=64,
        max_window_layers=1,
    )
    model = LlamaForCausalLM(load_hf_config(folder), TorchAttentionBackend, BLOCK_SIZE)
    assert [layer.self_attn.sliding_window for layer in model.model.layers] == [None, 64]
