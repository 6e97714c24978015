"""Weight formats as plugins: registration, the plan's choice of format per type, the
loader's fallback through the format, and GGUF tensor names asked of the model class."""

from __future__ import annotations

import pytest
import torch

import vlite
from vlite.core.errors import PluginError
from vlite.core.plugins import PluginRegistry, build_plugin_manager
from vlite.core.weight_format import WeightFormat, registered_weight_formats
from vlite.models.gguf import iter_gguf_weights
from vlite.models.gguf_names import LLAMA_LAYER_MODULES
from vlite.models.llama import LlamaForCausalLM
from vlite.models.loader import dequantized
from vlite.models.mixtral import MixtralForCausalLM
from vlite.models.quantization import plan_quantization
from vlite.plugins.weight_formats.gguf import GGUFBlockFormat
from vlite.testing.engine_runs import cached_tiny_model
from vlite.testing.tiny_gguf import write_tiny_gguf

CPU = torch.device("cpu")


class Q41Format(GGUFBlockFormat):
    tensor_types = frozenset({"Q4_1"})
    description = "a test's Q4_1"
    dequantized = 0

    def dequantize(self, weight):
        type(self).dequantized += 1
        return super().dequantize(weight)


class GpuOnlyFormat(GGUFBlockFormat):
    tensor_types = frozenset({"Q8_0", "IQ2_XXS"})

    def unavailable_reason(self, device):
        return None if torch.device(device).type == "cuda" else "it runs on CUDA only"


def plugin(name: str, cls: type):
    class Plugin:
        @vlite.hookimpl
        def register_weight_formats(self, register):
            register(name, cls)

    return Plugin()


# ---- registration ------------------------------------------------------------------------


def test_installed_formats_come_before_the_built_in_one():
    registry = PluginRegistry(build_plugin_manager(extra_plugins=(plugin("q41", Q41Format),)))
    formats = registered_weight_formats(registry)
    assert list(formats) == ["q41", "gguf"]
    assert isinstance(formats["q41"], Q41Format) and type(formats["gguf"]) is GGUFBlockFormat


@pytest.mark.parametrize(
    ("cls", "problem"),
    [
        (type("NotAFormat", (), {}), "does not subclass vlite.core.weight_format.WeightFormat"),
        (type("HalfAFormat", (WeightFormat,), {}), "does not implement block_values, cat_rows"),
    ],
)
def test_a_registered_format_must_be_a_whole_weight_format(cls, problem):
    with pytest.raises(PluginError, match=problem):
        PluginRegistry(build_plugin_manager(extra_plugins=(plugin("bad", cls),)))


# ---- the plan ----------------------------------------------------------------------------


def test_each_type_goes_to_the_first_format_that_takes_it_and_runs_here():
    formats = {"gpu": GpuOnlyFormat(), "q41": Q41Format(), "gguf": GGUFBlockFormat()}
    types = ["F32", "Q4_1", "Q4_1", "Q8_0", "IQ2_XXS"]
    plan = plan_quantization("auto", types, CPU, formats)
    assert plan.format_names == {"Q4_1": "q41", "Q8_0": "gguf"}  # gpu cannot run here
    assert plan.dequantized == {"IQ2_XXS": 1}
    assert plan.formats == {"Q4_1": formats["q41"], "Q8_0": formats["gguf"]}
    line = plan.describe(torch.float32)
    assert "Q4_1 x2 kept quantized (weight format 'q41': a test's Q4_1)" in line
    assert "Q8_0 x1 kept quantized (weight-only CPU kernels)" in line
    assert "IQ2_XXS x1 dequantized to float32" in line


def test_nothing_kept_names_why_each_format_that_takes_the_types_cannot_run():
    formats = {"gpu": GpuOnlyFormat()}
    plan = plan_quantization("auto", ["Q8_0"], CPU, formats)
    assert not plan.kept and plan.reason == "it runs on CUDA only"
    with pytest.raises(ValueError, match=r"quantization='gguf' .*\(gpu: IQ2_XXS, Q8_0\).*CUDA"):
        plan_quantization("gguf", ["Q8_0"], CPU, formats)
    with pytest.raises(ValueError, match="no weight format is registered"):
        plan_quantization("gguf", ["Q8_0"], CPU, {})


# ---- loading -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_q_file(tmp_path_factory):
    folder = cached_tiny_model("LlamaForCausalLM", num_kv_heads=2)
    path = tmp_path_factory.mktemp("gguf") / "tiny-q.gguf"
    return write_tiny_gguf(folder, path, quantize=("Q4_1", "Q8_0"))


def test_the_loader_hands_each_kept_type_to_its_format(tiny_q_file):
    formats = {"Q4_1": Q41Format(), "Q8_0": GGUFBlockFormat()}
    weights = dict(iter_gguf_weights(tiny_q_file, formats=formats, show_progress=False))
    q_proj = weights["model.layers.0.self_attn.q_proj.weight"]
    assert q_proj.tensor_type == "Q4_1" and isinstance(q_proj.format, Q41Format)
    embedding = weights["model.embed_tokens.weight"]
    assert embedding.tensor_type == "Q8_0" and type(embedding.format) is GGUFBlockFormat
    assert weights["model.norm.weight"].dtype == torch.float32


def test_a_model_without_quantized_support_gets_them_dequantized_by_their_format(tiny_q_file):
    formats = {"Q4_1": Q41Format()}
    weights = dict(iter_gguf_weights(tiny_q_file, formats=formats, show_progress=False))
    num_q41 = sum(isinstance(getattr(w, "format", None), Q41Format) for w in weights.values())
    Q41Format.dequantized = 0
    plain = dict(dequantized(weights.items()))
    assert num_q41 > 0 and Q41Format.dequantized == num_q41  # each through its format
    q_proj = "model.layers.0.self_attn.q_proj.weight"
    assert plain[q_proj].dtype == torch.float32
    assert torch.equal(plain[q_proj], weights[q_proj].dequantize())


# ---- names ---------------------------------------------------------------------------------


class FeedForwardLlama(LlamaForCausalLM):
    gguf_layer_modules = {
        **LLAMA_LAYER_MODULES,
        **{f"ffn_{p}": f"feed_forward.{p}_proj" for p in ("gate", "up", "down")},
    }


class NoHookModel:
    """A model class that does not name GGUF tensors itself."""


def test_the_loader_asks_the_model_class_for_names(tiny_q_file):
    names = [name for name, _ in iter_gguf_weights(tiny_q_file, model_cls=FeedForwardLlama,
                                                   show_progress=False)]  # fmt: skip
    assert "model.layers.1.feed_forward.down_proj.weight" in names
    assert not any(".mlp." in name for name in names)
    default = [n for n, _ in iter_gguf_weights(tiny_q_file, model_cls=NoHookModel,
                                               show_progress=False)]  # fmt: skip
    assert "model.layers.1.mlp.down_proj.weight" in default


def test_names_of_experts_and_refusals():
    assert (
        MixtralForCausalLM.hf_name_for_gguf_tensor("blk.2.ffn_down_exps.weight", expert=3)
        == "model.layers.2.block_sparse_moe.experts.3.w2.weight"
    )
    assert (
        MixtralForCausalLM.hf_name_for_gguf_tensor("blk.2.ffn_gate.7.weight")
        == "model.layers.2.block_sparse_moe.experts.7.w1.weight"
    )
    assert MixtralForCausalLM.hf_name_for_gguf_tensor("blk.0.ffn_gate_inp.weight") == (
        "model.layers.0.block_sparse_moe.gate.weight"
    )
    with pytest.raises(ValueError, match="LlamaForCausalLM has no experts"):
        LlamaForCausalLM.hf_name_for_gguf_tensor("blk.0.ffn_up_exps.weight", expert=0)
    with pytest.raises(ValueError, match="stacks every expert's matrix"):
        MixtralForCausalLM.hf_name_for_gguf_tensor("blk.0.ffn_up_exps.weight")
    with pytest.raises(ValueError, match="not a stacked experts tensor"):
        MixtralForCausalLM.hf_name_for_gguf_tensor("blk.0.attn_q.weight", expert=1)
    with pytest.raises(ValueError, match="unknown GGUF tensor 'blk.0.attn_qkv.weight'.*Llama"):
        LlamaForCausalLM.hf_name_for_gguf_tensor("blk.0.attn_qkv.weight")


def test_16_bit_float_matrices_are_kept_by_a_format_that_takes_them():
    plan = plan_quantization("auto", ["F32", "F16", "F16", "BF16"], CPU)
    assert plan.kept == {"F16": 2, "BF16": 1} and plan.dequantized == {}
    plan = plan_quantization("auto", ["F32", "F16"], CPU, {"q41": Q41Format()})
    assert not plan.kept and plan.reason == "the GGUF file holds no quantized tensor"


def test_plugin_api_3s_quantized_matrix_still_works():
    """docs/plugins.md (API 3) offered models `QuantizedMatrix`: its calls keep working."""
    import numpy as np

    from vlite.models.quantization import BlockQuantizedTensor, QuantizedMatrix
    from vlite.testing.tiny_gguf import random_quantized_matrix

    raw = random_quantized_matrix("Q4_1", 8, 64, np.random.default_rng(0))
    tensor = BlockQuantizedTensor("Q4_1", torch.from_numpy(raw.copy()), 64)
    matrix = QuantizedMatrix(tensor)
    assert isinstance(matrix, QuantizedMatrix) and not isinstance(torch.zeros(1), QuantizedMatrix)
    assert (matrix.qtype, matrix.out_features, matrix.in_features) == ("Q4_1", 8, 64)
    values = tensor.dequantize()
    x = torch.randn(3, 64)
    torch.testing.assert_close(matrix.matmul(x), x @ values.t(), rtol=1e-5, atol=1e-5)
    assert torch.equal(matrix.rows(torch.tensor([5, 1]), torch.float32), values[[5, 1]])
    assert torch.equal(matrix.narrow_rows(2, 3).dequantize(), values[2:5])


def test_every_quantized_activations_setting_has_the_formats_activations():
    from typing import get_args

    from vlite.core.config import VliteConfig
    from vlite.kernels.native import ACTIVATION_BITS
    from vlite.plugins.weight_formats.gguf import ACTIVATIONS

    choices = get_args(VliteConfig.model_fields["quantized_activations"].annotation)
    assert set(choices) == set(ACTIVATIONS)
    assert ACTIVATIONS["off"] == {}
    for setting in choices:
        assert set(ACTIVATIONS[setting].values()) <= set(ACTIVATION_BITS) - {"float32"}
