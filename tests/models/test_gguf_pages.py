"""The GGUF loader maps the file: quantized matrices are views of its pages (no second
copy), and the pages of every tensor it copies or decodes are let go once that is done."""

from __future__ import annotations

import torch

from vlite.core.weight_format import QuantizedWeight
from vlite.models.gguf import GGUFFile, iter_gguf_weights, read_gguf
from vlite.testing.tiny_gguf import write_tiny_gguf
from vlite.testing.tiny_models import make_tiny_model

KEEP = frozenset({"Q4_1", "Q8_0"})


def _tiny_file(tmp_path):
    folder = make_tiny_model(tmp_path / "hf", "LlamaForCausalLM")
    return write_tiny_gguf(folder, tmp_path / "tiny.gguf", quantize=("Q4_1", "Q8_0"))


def test_copied_tensors_pages_are_released_and_the_weights_read_again_equal(tmp_path, monkeypatch):
    path = _tiny_file(tmp_path)
    released = []
    release = GGUFFile.release_pages
    monkeypatch.setattr(
        GGUFFile, "release_pages", lambda self, t: (released.append(t.name), release(self, t))
    )
    first = dict(iter_gguf_weights(path, keep_types=KEEP, show_progress=False))
    gguf_file = read_gguf(path)
    assert gguf_file.mapping is not None
    kept = {
        t.name
        for t in gguf_file.tensors
        if t.tensor_type.name in KEEP
        and len(t.shape) == 2
        and "attn_q." not in t.name
        and "attn_k." not in t.name  # llama's q/k rows are reordered: a copy
    }
    assert kept, "the tiny file has quantized matrices"
    assert sorted(released) == sorted(t.name for t in gguf_file.tensors if t.name not in kept)
    second = dict(iter_gguf_weights(path, keep_types=KEEP, show_progress=False))
    for name, weight in first.items():
        if isinstance(weight, torch.Tensor):
            assert torch.equal(weight, second[name]), name
        else:
            assert torch.equal(weight.dequantize(), second[name].dequantize()), name


def test_kept_matrices_are_views_of_the_file_and_writing_one_leaves_the_file_alone(tmp_path):
    path = _tiny_file(tmp_path)
    original = path.read_bytes()
    weights = dict(iter_gguf_weights(path, keep_types=KEEP, show_progress=False))
    file_pointers = {int(t.data.ctypes.data) for t in read_gguf(path).tensors}
    down = weights["model.layers.0.mlp.down_proj.weight"]
    assert isinstance(down, QuantizedWeight)
    assert down.blocks.data_ptr() in file_pointers  # the map's bytes, not a copy
    q = weights["model.layers.0.self_attn.q_proj.weight"]
    assert q.blocks.data_ptr() not in file_pointers  # rows reordered: its own bytes
    down.blocks.zero_()  # copy-on-write: this process's pages only
    assert path.read_bytes() == original


def test_views_a_layer_joined_into_a_fused_weight_are_let_go(tmp_path, monkeypatch):
    from vlite import LLM

    path = _tiny_file(tmp_path)
    released: list[tuple[int, int]] = []
    release = GGUFFile.release_bytes
    monkeypatch.setattr(
        GGUFFile,
        "release_bytes",
        lambda self, offset, n: (released.append((offset, n)), release(self, offset, n)),
    )
    LLM(model=str(path), num_kv_blocks=8)
    tensors = {t.name: t for t in read_gguf(path).tensors}

    def was_released(name):
        t = tensors[name]
        return any(o <= t.data_offset and t.data_offset + t.n_bytes <= o + n for o, n in released)

    # v, gate and up were views, then copied into the fused qkv and gate_up weights
    for name in ("blk.0.attn_v.weight", "blk.0.ffn_gate.weight", "blk.0.ffn_up.weight"):
        assert tensors[name].tensor_type.name in KEEP
        assert was_released(name), name
    # down and o stay the weights themselves: the file's pages
    for name in ("blk.0.ffn_down.weight", "blk.0.attn_output.weight"):
        assert tensors[name].tensor_type.name in KEEP
        assert not was_released(name), name
