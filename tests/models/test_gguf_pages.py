"""The GGUF loader maps the file and lets each tensor's pages go once it is copied."""

from __future__ import annotations

import torch

from vlite.models.gguf import GGUFFile, iter_gguf_weights, read_gguf
from vlite.testing.tiny_gguf import write_tiny_gguf
from vlite.testing.tiny_models import make_tiny_model


def test_every_tensors_pages_are_released_and_the_weights_read_again_equal(tmp_path, monkeypatch):
    folder = make_tiny_model(tmp_path / "hf", "LlamaForCausalLM")
    path = write_tiny_gguf(folder, tmp_path / "tiny.gguf", quantize=("Q4_1", "Q8_0"))
    released = []
    release = GGUFFile.release_pages
    monkeypatch.setattr(
        GGUFFile, "release_pages", lambda self, t: (released.append(t.name), release(self, t))
    )
    keep = frozenset({"Q4_1", "Q8_0"})
    first = dict(iter_gguf_weights(path, keep_types=keep, show_progress=False))
    assert read_gguf(path).mapping is not None
    assert sorted(released) == sorted(t.name for t in read_gguf(path).tensors)
    second = dict(iter_gguf_weights(path, keep_types=keep, show_progress=False))
    for name, weight in first.items():
        if isinstance(weight, torch.Tensor):
            assert torch.equal(weight, second[name]), name
        else:
            assert torch.equal(weight.dequantize(), second[name].dequantize()), name
