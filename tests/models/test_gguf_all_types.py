"""A model whose every matrix is one GGUF type runs on that type's kernel, and its greedy
tokens equal the float32 path's (the same file dequantized by gguf-py).

gguf-py cannot quantize to the K-quants or IQ4, so the files hold random blocks of each
type (small fp16 scales, every other bit random): the values are the format's, whatever
they are, which is what the kernels must reproduce.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from vlite import LLM, SamplingParams
from vlite.kernels.native import BLOCK_LAYOUTS
from vlite.testing import tiny_gguf
from vlite.testing.tiny_gguf import random_quantized_matrix, write_tiny_gguf
from vlite.testing.tiny_models import make_tiny_model

TYPES = sorted(BLOCK_LAYOUTS.keys() - {"Q4_0", "Q4_1", "Q8_0"})  # those: test_gguf.py


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    # Hidden and inner sizes that 256-value blocks divide.
    return make_tiny_model(
        tmp_path_factory.mktemp("hf"), "LlamaForCausalLM", hidden_size=256, intermediate_size=512
    )


def write_file(folder, path, qtype: str, monkeypatch) -> None:
    rng = np.random.default_rng(0)
    add_tensor = tiny_gguf._add_tensor

    def random_blocks(writer, name, array, quantize, float_type):
        if array.ndim != 2:
            return add_tensor(writer, name, array, quantize, float_type)
        kind = gguf.GGMLQuantizationType[qtype]
        blocks = random_quantized_matrix(qtype, *array.shape, rng, scale_range=(2e-4, 2e-3))
        writer.add_tensor(name, blocks, raw_dtype=kind)

    monkeypatch.setattr(tiny_gguf, "_add_tensor", random_blocks)
    write_tiny_gguf(folder, path)


@pytest.mark.parametrize("qtype", TYPES)
def test_every_matrix_of_one_type_stays_quantized_and_equals_the_float_path(
    tiny_folder, tmp_path, qtype, monkeypatch
):
    path = tmp_path / f"tiny-{qtype}.gguf"
    write_file(tiny_folder, path, qtype, monkeypatch)
    prompts = [[5, 6, 7, 8, 9], list(range(20, 60)), [100, 3]]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    tokens = {}
    for quantization in ("auto", "none"):
        llm = LLM(model=str(path), quantization=quantization, num_kv_blocks=32)
        model = llm.llm_engine.engine_core.executor.worker.runner.model
        layer = model.model.layers[0]
        kept = [layer.mlp.gate_up_proj, layer.mlp.down_proj, layer.self_attn.o_proj]
        kept.append(model.model.embed_tokens)
        assert all((m.quantized is not None) == (quantization == "auto") for m in kept)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        tokens[quantization] = [o.outputs[0].token_ids for o in outputs]
    assert tokens["auto"] == tokens["none"]
