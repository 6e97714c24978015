"""Engine construction refuses settings that need a capability a plugin says it lacks."""

from __future__ import annotations

import pytest

import vlite
from vlite import LLM
from vlite.core.plugins import PluginRegistry, build_plugin_manager
from vlite.plugins.attention.torch_ref import TorchAttentionBackend
from vlite.testing.tiny_models import make_tiny_model


class NoCachedContextBackend(TorchAttentionBackend):
    """Claims it cannot attend several new tokens after cached context."""

    supports_prefix_caching = False


class NoCachedContextPlugin:
    @vlite.hookimpl
    def register_attention_backends(self, register):
        register("no-cached-context", NoCachedContextBackend)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return str(make_tiny_model(tmp_path_factory.mktemp("model"), "LlamaForCausalLM"))


@pytest.fixture(scope="module")
def registry() -> PluginRegistry:
    return PluginRegistry(build_plugin_manager(extra_plugins=(NoCachedContextPlugin(),)))


def test_prefix_caching_on_a_backend_without_it_is_refused(model, registry):
    with pytest.raises(ValueError, match="'no-cached-context' does not support prefix caching"):
        LLM(model=model, attention_backend="no-cached-context", registry=registry)


def test_the_backend_runs_with_prefix_caching_off(model, registry):
    llm = LLM(
        model=model,
        attention_backend="no-cached-context",
        enable_prefix_caching=False,
        registry=registry,
    )
    [output] = llm.generate(["hello"], vlite.SamplingParams(max_tokens=3), use_tqdm=False)
    assert len(output.outputs[0].token_ids) == 3


def test_chunked_prefill_on_a_backend_without_cached_context_is_refused(model, registry):
    with pytest.raises(ValueError, match="splits prompts into chunks"):
        LLM(
            model=model,
            attention_backend="no-cached-context",
            scheduler="chunked-prefill",
            enable_prefix_caching=False,
            registry=registry,
        )
