"""``auto``: the preference order, limits, errors, and what the engine ends up using."""

from __future__ import annotations

import pytest
import torch

from vlite import LLM, SamplingParams
from vlite.core.attention import AttentionBackend
from vlite.core.plugins import PluginRegistry, build_plugin_manager
from vlite.kernels import native
from vlite.plugins.attention import flash
from vlite.plugins.attention.auto import (
    AUTO_PREFERENCES,
    AutoAttentionBackend,
    resolve_attention_backend,
)
from vlite.plugins.attention.cpu_native import CpuAttentionBackend
from vlite.plugins.attention.torch_ref import TorchAttentionBackend
from vlite.plugins.attention.triton_paged import TritonAttentionBackend
from vlite.testing.attention_cases import AttentionShape, boundary_batch, run_case

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


@pytest.fixture(scope="module")
def registry() -> PluginRegistry:
    return PluginRegistry(build_plugin_manager(load_entry_points=False))


def choose(registry, device, dtype, **limits) -> str:
    return resolve_attention_backend("auto", device, dtype, registry, **limits)[0]


def test_documented_order():
    assert AUTO_PREFERENCES == {"cuda": ("flash", "triton", "torch"), "cpu": ("cpu", "torch")}


def test_cpu_float32_resolves_to_the_c_kernel(registry):
    name, cls = resolve_attention_backend("auto", CPU, torch.float32, registry, head_dim=64)
    assert (name, cls) == ("cpu", CpuAttentionBackend)


def test_cpu_without_a_compiler_falls_back_to_torch(registry, monkeypatch):
    monkeypatch.setattr(native, "unavailable_reason", lambda: "no C compiler found")
    assert choose(registry, CPU, torch.float32, head_dim=64) == "torch"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cpu_low_precision_resolves_to_torch(registry, dtype):
    name, cls = resolve_attention_backend("auto", CPU, dtype, registry, head_dim=64)
    assert (name, cls) == ("torch", TorchAttentionBackend)


def test_cuda_prefers_flash_when_flash_attn_imports(registry, monkeypatch):
    monkeypatch.setattr(flash, "flash_attn_import_error", lambda: None)
    assert choose(registry, CUDA, torch.bfloat16) == "flash"
    assert choose(registry, CUDA, torch.float16) == "flash"
    # flash-attn has no float32: the next in line.
    assert choose(registry, CUDA, torch.float32) == "triton"


def test_cuda_without_flash_attn_resolves_to_triton(registry, monkeypatch):
    monkeypatch.setattr(flash, "flash_attn_import_error", lambda: "not installed")
    assert choose(registry, CUDA, torch.bfloat16, head_dim=128, block_size=16) == "triton"


def test_declared_limits_move_down_the_order(registry, monkeypatch):
    monkeypatch.setattr(flash, "flash_attn_import_error", lambda: "not installed")
    # Triton takes head dims that are multiples of 16 and blocks of 16 to 256 tokens.
    assert choose(registry, CUDA, torch.bfloat16, head_dim=8) == "torch"
    assert choose(registry, CUDA, torch.bfloat16, head_dim=128, block_size=8) == "torch"
    monkeypatch.setattr(flash, "flash_attn_import_error", lambda: None)
    assert choose(registry, CUDA, torch.bfloat16, head_dim=8) == "flash"


def test_no_usable_backend_lists_every_reason(monkeypatch):
    class Never(AttentionBackend):
        @classmethod
        def unavailable_reason(cls, device, dtype):
            return "never here"

        def forward(self, *args):  # pragma: no cover - never constructed
            raise AssertionError

    class FakeRegistry:
        def names(self, kind):
            return ["auto", "flash"]

        def get(self, kind, name):
            return {"auto": AutoAttentionBackend, "flash": Never}[name]

    with pytest.raises(ValueError) as info:
        resolve_attention_backend("auto", CUDA, torch.bfloat16, FakeRegistry())
    message = str(info.value)
    assert "flash: never here" in message
    assert "triton: not registered" in message and "torch: not registered" in message


def test_an_explicit_backend_that_cannot_run_is_an_error_with_the_reason(registry, monkeypatch):
    monkeypatch.setattr(flash, "flash_attn_import_error", lambda: "not installed")
    with pytest.raises(ValueError, match="'flash' cannot run on cuda in bfloat16: .*pip install"):
        resolve_attention_backend("flash", CUDA, torch.bfloat16, registry)


def test_explicit_backends_resolve_to_themselves(registry):
    assert resolve_attention_backend("triton", CPU, torch.float32, registry) == (
        "triton",
        TritonAttentionBackend,
    )


def test_unknown_names_list_the_available_ones(registry):
    with pytest.raises(ValueError, match="available: auto, cpu, flash, torch, triton"):
        resolve_attention_backend("nope", CPU, torch.float32, registry)


def test_constructed_directly_it_delegates_to_the_choice():
    shape = AttentionShape(32, 2, 16)
    backend = AutoAttentionBackend(shape.num_heads, 2, 32, shape.scale, 16)
    assert backend.delegate_name == "cpu"
    assert isinstance(backend.delegate, CpuAttentionBackend)
    for result in run_case(backend, shape, boundary_batch(16)):
        torch.testing.assert_close(result.output.double(), result.expected, atol=1e-4, rtol=1e-4)


def test_the_engine_uses_what_auto_chose(tmp_path):
    from vlite.testing.tiny_models import make_tiny_model

    folder = make_tiny_model(tmp_path, "LlamaForCausalLM")
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    tokens = {}
    for name in ("auto", "cpu"):
        llm = LLM(model=str(folder), attention_backend=name, num_kv_blocks=16)
        worker = llm.llm_engine.engine_core.executor.worker
        assert worker.attention_backend_name == "cpu"
        assert type(worker.runner.model.attention) is CpuAttentionBackend
        outputs = llm.generate([{"prompt_token_ids": [5, 6, 7, 8, 9]}], params, use_tqdm=False)
        tokens[name] = outputs[0].outputs[0].token_ids
    assert tokens["auto"] == tokens["cpu"]
