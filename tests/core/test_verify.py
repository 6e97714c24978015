"""The configuration phase (vlite/core/verify.py): every refusal comes before the executor is
built, and what it resolved is what the later stages use."""

from __future__ import annotations

import copy
import warnings
from pathlib import Path

import pytest
import torch

import vlite
from vlite.core.attention_selection import resolve_attention_backend
from vlite.core.config import VliteConfig
from vlite.core.engine_core import EngineCore
from vlite.core.errors import ConfigError
from vlite.core.model_split import check_model_split
from vlite.core.plugins import PluginRegistry, build_plugin_manager
from vlite.core.verify import verify_config
from vlite.models.spec import ModelSpec
from vlite.plugins.attention.auto import AutoAttentionBackend
from vlite.plugins.attention.cpu_native import CpuAttentionBackend
from vlite.plugins.attention.torch_ref import TorchAttentionBackend
from vlite.plugins.executors.uniproc import UniprocExecutor
from vlite.testing.tiny_gguf import write_tiny_gguf
from vlite.testing.tiny_models import make_tiny_model

#: The configs each RecordingExecutor was built with, in order.
BUILT: list[VliteConfig] = []


class RecordingExecutor(UniprocExecutor):
    """``uniproc``, recording the configuration it is built with."""

    def __init__(self, config: VliteConfig, registry: PluginRegistry) -> None:
        BUILT.append(config)
        super().__init__(config, registry)


class NoCachedContextBackend(TorchAttentionBackend):
    supports_prefix_caching = False


class NoWindowsBackend(TorchAttentionBackend):
    supports_sliding_window = False


class BigBlocksBackend(TorchAttentionBackend):
    supported_block_sizes = (32,)


class NeverHereBackend(TorchAttentionBackend):
    @classmethod
    def unavailable_reason(cls, device, dtype):
        return "never here"


class Plugin:
    @vlite.hookimpl
    def register_executors(self, register):
        register("recording", RecordingExecutor)

    @vlite.hookimpl
    def register_attention_backends(self, register):
        register("no-cached-context", NoCachedContextBackend)
        register("no-windows", NoWindowsBackend)
        register("big-blocks", BigBlocksBackend)
        register("never-here", NeverHereBackend)


class SpecWith:
    """A model description with some answers replaced."""

    def __init__(self, spec: ModelSpec, **answers) -> None:
        self._spec, self._answers = spec, answers

    def __getattr__(self, name):
        if name in self._answers:
            return self._answers[name]
        return getattr(self._spec, name)


@pytest.fixture(scope="module")
def registry() -> PluginRegistry:
    return PluginRegistry(build_plugin_manager(extra_plugins=(Plugin(),)))


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> str:
    return str(make_tiny_model(tmp_path_factory.mktemp("llama"), "LlamaForCausalLM"))


@pytest.fixture(scope="module")
def gguf(tmp_path_factory, llama) -> str:
    folder = tmp_path_factory.mktemp("gguf")
    return str(write_tiny_gguf(Path(llama), folder / "tiny.gguf", quantize=("Q4_1", "Q8_0")))


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory) -> str:
    return str(make_tiny_model(tmp_path_factory.mktemp("gemma2"), "Gemma2ForCausalLM"))


@pytest.fixture(autouse=True)
def no_executor_built_yet():
    BUILT.clear()


def _config(model: str, **settings) -> VliteConfig:
    settings = {"executor": "recording", "device": "cpu", "num_kv_blocks": 16, **settings}
    return VliteConfig(model=model, **settings)


def _unregistered_architecture(spec: ModelSpec) -> SpecWith:
    hf_config = copy.deepcopy(spec.hf_config)
    hf_config.architectures = ["NopeForCausalLM"]
    return SpecWith(spec, architecture="NopeForCausalLM", hf_config=hf_config)


REFUSALS = [
    ("llama", {"scheduler": "nope"}, None, "unknown scheduler 'nope'; available:"),
    ("llama", {"sampler": "nope"}, None, "unknown sampler 'nope'; available:"),
    ("llama", {"attention_backend": "nope"}, None, "unknown attention_backend 'nope'"),
    (
        "llama",
        {"structured_outputs_backend": "nope"},
        None,
        "unknown structured_output_backend 'nope'",
    ),
    ("llama", {}, _unregistered_architecture, "'NopeForCausalLM' .* is not supported; supported"),
    (
        "llama",
        {"enable_prefix_caching": True},
        lambda spec: SpecWith(spec, prefix_caching_conflict="it rotates keys again"),
        "enable_prefix_caching=True cannot be exact for this model: it rotates keys again",
    ),
    ("llama", {"pipeline_parallel_size": 3}, None, "pipeline_parallel_size=3 exceeds the model"),
    (
        "llama",
        {"pipeline_parallel_size": 2, "pp_layer_partition": (2, 1)},
        None,
        "pp_layer_partition=2,1 must give each of the 2 stages",
    ),
    ("llama", {"tensor_parallel_size": 3}, None, "tensor_parallel_size=3 does not divide"),
    (
        "llama",
        {"attention_backend": "never-here"},
        None,
        "'never-here' cannot run on cpu in float32: never here",
    ),
    (
        "llama",
        {"attention_backend": "big-blocks", "block_size": 16},
        None,
        "attention_backend='big-blocks': .* does not support block size 16; it supports: 32",
    ),
    (
        "llama",
        {"attention_backend": "no-cached-context"},
        None,
        "'no-cached-context' does not support prefix caching",
    ),
    (
        "llama",
        {
            "attention_backend": "no-cached-context",
            "enable_prefix_caching": False,
            "scheduler": "chunked-prefill",
        },
        None,
        "chunked prefill splits prompts into chunks",
    ),
    (
        "gemma2",
        {"attention_backend": "no-windows"},
        None,
        "'no-windows' cannot run this model: its layers .* sliding window",
    ),
    ("llama", {"quantization": "gguf"}, None, "quantization='gguf' .* not a GGUF file"),
    (
        "llama",
        {"attention_backend": "torch", "kv_cache_dtype": "float16"},
        None,
        "kv_cache_dtype='float16': attention backend 'torch' takes no float16 cache with a "
        "float32 model; allowed: auto, float32",
    ),
]


@pytest.mark.parametrize(("model", "settings", "describe", "message"), REFUSALS)
def test_each_refusal_comes_before_any_executor_is_built(
    request, registry, model, settings, describe, message
):
    config = _config(request.getfixturevalue(model), **settings)
    spec = ModelSpec.from_config(config)
    if describe is not None:
        spec = describe(spec)
    with pytest.raises(ConfigError, match=message):
        verify_config(config, spec, registry)
    with pytest.raises(ConfigError, match=message):
        EngineCore(config, spec, registry)
    assert BUILT == []


def test_auto_is_resolved_once_before_the_executor_and_used_by_every_stage(
    llama, registry, monkeypatch
):
    choices = []
    choose = AutoAttentionBackend.choose_backend.__func__

    def counting_choose(cls, *args, **kwargs):
        choices.append(choose(cls, *args, **kwargs))
        return choices[-1]

    monkeypatch.setattr(AutoAttentionBackend, "choose_backend", classmethod(counting_choose))
    config = _config(llama, attention_backend="auto")
    core = EngineCore(config, ModelSpec.from_config(config), registry)
    try:
        [chosen] = choices  # once: the workers are handed the name, not "auto"
        assert chosen != "auto" and chosen in registry.names("attention_backend")
        assert [built.attention_backend for built in BUILT] == [chosen]
        assert core.config.attention_backend == core.attention_backend_name == chosen
        assert core.executor.worker.attention_backend_name == chosen
        assert type(core.executor.worker.runner.model.attention) is registry.get(
            "attention_backend", chosen
        )
    finally:
        core.shutdown()


def test_auto_resolves_as_the_shared_selection_does(llama, registry):
    config = _config(llama)
    spec = ModelSpec.from_config(config)
    verified = verify_config(config, spec, registry)
    expected, backend_cls = resolve_attention_backend(
        "auto", torch.device("cpu"), torch.float32, registry, head_dim=spec.head_dim, block_size=16
    )
    assert verified.attention_backend == expected
    assert verified.plugins["attention_backend"] is backend_cls
    assert config.attention_backend == "auto"  # the caller's config is left alone


def test_the_core_builds_with_what_the_phase_resolved(llama, registry):
    config = _config(llama, scheduler="chunked-prefill")
    spec = ModelSpec.from_config(config)
    core = EngineCore(config, spec, registry)
    try:
        verified = core.verified
        assert verified.limits.enable_chunked_prefill is True  # the scheduler's default
        assert core.scheduler.limits == verified.limits
        assert core.quantization is verified.quantization
        assert core.sampler_cls is verified.plugins["sampler"]
        assert [verified.config] == BUILT
    finally:
        core.shutdown()


def test_a_model_conflicting_with_prefix_caching_turns_the_default_off(llama, registry):
    config = _config(llama)
    spec = SpecWith(ModelSpec.from_config(config), prefix_caching_conflict="it rotates again")
    with pytest.warns(UserWarning, match="prefix caching is off for this model: it rotates"):
        core = EngineCore(config, spec, registry)
    try:
        assert not core.config.enable_prefix_caching
        assert not BUILT[0].enable_prefix_caching  # the executor got it off too
        assert not core.kv_cache_manager.enable_prefix_caching
    finally:
        core.shutdown()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # turned off by the caller: nothing to say
        verified = verify_config(_config(llama, enable_prefix_caching=False), spec, registry)
    assert not verified.config.enable_prefix_caching


class _PlainRefusal:
    """A model class whose split check raises a plain ``ValueError``, as its interface allows."""

    supports_tensor_parallel = True

    @classmethod
    def check_tensor_parallel_size(cls, hf_config, tensor_parallel_size):
        if tensor_parallel_size != 1:
            raise ValueError("only one rank")


class _NoParallelism:
    """A model class that declares no parallelism."""


def test_a_plain_value_error_from_the_model_class_becomes_a_config_error(llama):
    hf_config = ModelSpec.from_config(VliteConfig(model=llama)).hf_config
    with pytest.raises(ConfigError, match="tensor_parallel_size=2: only one rank"):
        check_model_split(VliteConfig(tensor_parallel_size=2), _PlainRefusal, hf_config, "X")
    check_model_split(VliteConfig(), _PlainRefusal, hf_config, "X")  # one rank: not asked


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ({"tensor_parallel_size": 2}, r"_NoParallelism \(X\) does not support tensor"),
        ({"pipeline_parallel_size": 2}, r"_NoParallelism \(X\) does not support pipeline"),
    ],
)
def test_a_model_class_without_the_parallelism_is_refused(llama, setting, message):
    hf_config = ModelSpec.from_config(VliteConfig(model=llama)).hf_config
    with pytest.raises(ConfigError, match=message):
        check_model_split(VliteConfig(**setting), _NoParallelism, hf_config, "X")


@pytest.mark.parametrize(
    ("model", "setting", "backend", "expected"),
    [
        ("gguf", "auto", "cpu", torch.float16),  # llama.cpp's files, as llama.cpp caches them
        ("gguf", "auto", "torch", torch.float32),  # a backend without float16 caches
        ("llama", "auto", "cpu", torch.float32),  # a checkpoint keeps transformers' arithmetic
        ("gguf", "float32", "cpu", torch.float32),
        ("llama", "float16", "cpu", torch.float16),
    ],
)
def test_kv_cache_dtype_resolves_per_model_and_backend(request, model, setting, backend, expected):
    if backend == "cpu" and CpuAttentionBackend.unavailable_reason(torch.device("cpu"), None):
        pytest.skip("no C compiler here")
    path = request.getfixturevalue(model)
    llm = vlite.LLM(model=path, attention_backend=backend, kv_cache_dtype=setting, num_kv_blocks=8)
    core = llm.llm_engine.engine_core
    assert core.config.kv_cache_dtype == str(expected).removeprefix("torch.")  # never "auto"
    worker = core.executor.worker
    assert worker.kv_cache_dtype == expected
    assert {cache.dtype for cache in worker.runner.kv_caches} == {expected}
    assert worker.kv_cache_bytes_per_block() == (
        worker.runner.kv_caches[0][:, :1].numel() * len(worker.runner.kv_caches) * expected.itemsize
    )
