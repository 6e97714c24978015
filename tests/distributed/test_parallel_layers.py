"""Tensor-parallel layers and weight slicing, checked in one process (no collectives run).

A rank's shard is built with a :class:`TensorParallelGroup` whose collectives are stand-ins:
``all_reduce`` leaves the partial sum alone and ``all_gather`` returns the local part, so a
test combines the ranks' outputs itself (sum, or concatenate) and compares with the full
layer.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from vlite.distributed import SINGLE_RANK
from vlite.models.llama import LlamaForCausalLM, check_tensor_parallel_size
from vlite.models.loader import build_model, iter_safetensors_weights, load_hf_config
from vlite.models.parallel_layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelLMHead,
)
from vlite.plugins.attention.torch_ref import TorchAttentionBackend
from vlite.testing.engine_runs import cached_tiny_model
from vlite.testing.local_ranks import LocalOnlyGroup, ranks


@pytest.fixture
def generator() -> torch.Generator:
    return torch.Generator().manual_seed(0)


# ---- world size 1: exactly nn.Linear ---------------------------------------------------------


def test_layers_at_world_size_one_equal_plain_linears(generator):
    x = torch.randn(5, 8, generator=generator)
    reference = nn.Linear(8, 12)
    column = ColumnParallelLinear(8, {"a": 4, "b": 8}, bias=True)
    column.load_full("weight", reference.weight.detach())
    column.load_full("bias", reference.bias.detach())
    assert torch.equal(column(x), reference(x))

    row = RowParallelLinear(8, 12, bias=True)
    row.load_full("weight", reference.weight.detach())
    row.load_full("bias", reference.bias.detach())
    assert torch.equal(row(x), reference(x))

    head = VocabParallelLMHead(12, 8, has_weight=True)
    head.load_full("weight", reference.weight.detach())
    assert torch.equal(head(x), F.linear(x, reference.weight).float())
    tied = VocabParallelLMHead(12, 8, has_weight=False)
    assert torch.equal(tied(x, reference.weight), F.linear(x, reference.weight).float())


# ---- shards combine to the full layer --------------------------------------------------------


def test_column_parallel_splits_each_piece_separately(generator):
    sizes = {"q": 8, "k": 4, "v": 4}  # e.g. 4 query heads and 2 KV heads of dim 2
    pieces = {name: torch.randn(size, 6, generator=generator) for name, size in sizes.items()}
    x = torch.randn(3, 6, generator=generator)
    shards = []
    for group in ranks(2):
        layer = ColumnParallelLinear(6, sizes, bias=False, tp_group=group)
        for name, weight in pieces.items():
            layer.load_full("weight", weight, name)
        # rank r holds rows [r*half, (r+1)*half) of every piece, in piece order
        expected = torch.cat(
            [w[group.rank * len(w) // 2 :][: len(w) // 2] for w in pieces.values()]
        )
        assert torch.equal(layer.weight, expected)
        shards.append(layer(x).split([s // 2 for s in sizes.values()], dim=-1))
    for index, name in enumerate(sizes):
        full = F.linear(x, pieces[name])
        assert torch.allclose(torch.cat([shard[index] for shard in shards], -1), full)


def test_column_parallel_loads_a_whole_fused_tensor_like_its_pieces(generator):
    sizes = {"gate": 6, "up": 6}
    fused = torch.randn(12, 4, generator=generator)
    for group in ranks(3):
        whole = ColumnParallelLinear(4, sizes, bias=False, tp_group=group)
        whole.load_full("weight", fused)
        by_piece = ColumnParallelLinear(4, sizes, bias=False, tp_group=group)
        by_piece.load_full("weight", fused[:6], "gate")
        by_piece.load_full("weight", fused[6:], "up")
        assert torch.equal(whole.weight, by_piece.weight)


def test_row_parallel_partial_sums_add_up_and_the_bias_is_added_once(generator):
    weight = torch.randn(5, 8, generator=generator)
    bias = torch.randn(5, generator=generator)
    x = torch.randn(3, 8, generator=generator)
    total = torch.zeros(3, 5)
    for group in ranks(2):
        layer = RowParallelLinear(8, 5, bias=True, tp_group=group)
        layer.load_full("weight", weight)
        layer.load_full("bias", bias)
        start, end = group.shard_range(8)
        total += layer(x[:, start:end]) - bias  # each rank's output is partial + bias
    assert torch.allclose(total + bias, F.linear(x, weight, bias), atol=1e-6)


@pytest.mark.parametrize("world_size", [2, 3])
def test_vocab_parallel_head_pads_an_uneven_vocabulary(generator, world_size):
    vocab, hidden = 10, 4  # 10 rows over 3 ranks: 4, 4, 2 (padded to 4)
    weight = torch.randn(vocab, hidden, generator=generator)
    x = torch.randn(2, hidden, generator=generator)
    untied_parts, tied_parts = [], []
    for group in ranks(world_size):
        head = VocabParallelLMHead(vocab, hidden, has_weight=True, tp_group=group)
        head.load_full("weight", weight)
        untied_parts.append(head(x))
        tied = VocabParallelLMHead(vocab, hidden, has_weight=False, tp_group=group)
        tied_parts.append(tied(x, weight))
        assert untied_parts[-1].shape == (2, -(-vocab // world_size))
    full = F.linear(x, weight)
    for parts in (untied_parts, tied_parts):
        assert torch.allclose(torch.cat(parts, -1)[:, :vocab], full)


def test_single_rank_collectives_make_no_distributed_call(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("a collective ran at world size 1")

    monkeypatch.setattr(torch.distributed, "all_reduce", forbidden)
    monkeypatch.setattr(torch.distributed, "all_gather", forbidden)
    x = torch.ones(2, 3)
    assert SINGLE_RANK.all_reduce(x) is x
    assert SINGLE_RANK.all_gather(x) is x
    assert not SINGLE_RANK.is_parallel


# ---- whole models: Hugging Face tensors sliced per rank -------------------------------------


def build_shard(folder, group, load_format="auto"):
    return build_model(
        load_hf_config(folder),
        LlamaForCausalLM,
        TorchAttentionBackend,
        block_size=4,
        dtype=torch.float32,
        device="cpu",
        load_format=load_format,
        folder=None if load_format == "dummy" else folder,
        tp_group=group,
    )


def test_qwen2_qkv_weights_and_biases_are_sliced_by_whole_heads():
    folder = cached_tiny_model("Qwen2ForCausalLM", num_kv_heads=2, tie_word_embeddings=False)
    hf = dict(iter_safetensors_weights(folder))
    head_dim = 16  # hidden 64 / 4 heads
    for group in ranks(2):
        attn = build_shard(folder, group).model.layers[1].self_attn
        assert (attn.num_heads, attn.num_kv_heads) == (2, 1)
        for leaf in ("weight", "bias"):
            q = hf[f"model.layers.1.self_attn.q_proj.{leaf}"]
            k = hf[f"model.layers.1.self_attn.k_proj.{leaf}"]
            v = hf[f"model.layers.1.self_attn.v_proj.{leaf}"]
            q_rows = slice(group.rank * 2 * head_dim, (group.rank + 1) * 2 * head_dim)
            kv_rows = slice(group.rank * head_dim, (group.rank + 1) * head_dim)
            expected = torch.cat([q[q_rows], k[kv_rows], v[kv_rows]])
            assert torch.equal(getattr(attn.qkv_proj, leaf), expected)
        o = hf["model.layers.1.self_attn.o_proj.weight"]
        assert torch.equal(attn.o_proj.weight, o[:, group.rank * 32 : (group.rank + 1) * 32])


def test_qwen3_qk_norms_and_tied_embeddings_are_replicated():
    folder = cached_tiny_model("Qwen3ForCausalLM")
    hf = dict(iter_safetensors_weights(folder))
    for group in ranks(2):
        model = build_shard(folder, group)
        attn = model.model.layers[0].self_attn
        assert torch.equal(attn.q_norm.weight, hf["model.layers.0.self_attn.q_norm.weight"])
        assert torch.equal(attn.k_norm.weight, hf["model.layers.0.self_attn.k_norm.weight"])
        assert torch.equal(model.model.embed_tokens.weight, hf["model.embed_tokens.weight"])
        assert model.lm_head.weight is None  # tied: rows of the embedding are used
        gate_up = model.model.layers[0].mlp.gate_up_proj.weight
        gate = hf["model.layers.0.mlp.gate_proj.weight"]
        up = hf["model.layers.0.mlp.up_proj.weight"]
        rows = slice(group.rank * 64, (group.rank + 1) * 64)
        assert torch.equal(gate_up, torch.cat([gate[rows], up[rows]]))


def test_dummy_weights_are_the_same_model_at_every_tensor_parallel_size():
    folder = cached_tiny_model("LlamaForCausalLM", num_kv_heads=4, tie_word_embeddings=False)
    full = build_shard(folder, SINGLE_RANK, "dummy")
    shards = [build_shard(folder, group, "dummy") for group in ranks(2)]
    for name, param in full.named_parameters():
        parts = [dict(shard.named_parameters())[name] for shard in shards]
        if name.endswith("qkv_proj.weight"):
            split = [64, 64, 64]  # q, k, v rows at world size 1 (4 heads of 16)
            pieces = zip(*(part.split([s // 2 for s in split]) for part in parts))
            assert torch.equal(torch.cat([torch.cat(p) for p in pieces]), param), name
        elif name.endswith("gate_up_proj.weight"):
            pieces = zip(*(part.chunk(2) for part in parts))
            assert torch.equal(torch.cat([torch.cat(p) for p in pieces]), param), name
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            assert torch.equal(torch.cat(parts, dim=1), param), name
        elif name == "lm_head.weight":
            assert torch.equal(torch.cat(parts), param), name
        else:
            assert all(torch.equal(part, param) for part in parts), name


# ---- which sizes a model allows --------------------------------------------------------------


def smollm2_like(**overrides):
    fields = dict(
        model_type="llama", num_attention_heads=9, num_key_value_heads=3, intermediate_size=1536
    )
    return SimpleNamespace(**{**fields, **overrides})


def test_a_size_that_does_not_divide_the_heads_names_the_values_and_the_allowed_sizes():
    with pytest.raises(ValueError) as error:
        check_tensor_parallel_size(smollm2_like(), 2)
    message = str(error.value)
    assert "tensor_parallel_size=2" in message
    assert "num_attention_heads=9" in message and "num_key_value_heads=3" in message
    assert "intermediate_size" not in message  # 1536 splits in two
    assert "supports tensor_parallel_size in {1, 3}" in message
    check_tensor_parallel_size(smollm2_like(), 3)


def test_more_ranks_than_kv_heads_says_kv_heads_are_not_replicated():
    config = smollm2_like(num_attention_heads=8, num_key_value_heads=2, intermediate_size=64)
    with pytest.raises(ValueError, match=r"does not replicate KV heads.*\{1, 2\}"):
        check_tensor_parallel_size(config, 4)


def test_the_model_checks_its_size_at_construction():
    folder = cached_tiny_model("LlamaForCausalLM")  # 4 heads, 2 KV heads
    with pytest.raises(ValueError, match="num_attention_heads=4"):
        build_shard(folder, LocalOnlyGroup(0, 3), "dummy")
