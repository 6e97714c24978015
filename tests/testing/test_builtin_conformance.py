"""Every conformance suite over every built-in plugin, discovered from the registry.

A built-in plugin (one of vlite's ``vlite.builtin`` entry points, in pyproject.toml) is
conformance-tested here without any change to this file. Installed third-party plugins are
not loaded (their own tests run the suites on them).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest

from vlite.core.plugins import PLUGIN_KINDS, PluginRegistry, build_plugin_manager
from vlite.core.proposer import WorkerProposer
from vlite.testing import (
    AttentionBackendConformance,
    ExecutorConformance,
    LogitsProcessorConformance,
    ModelConformance,
    ProposerConformance,
    ReasoningParserConformance,
    SamplerConformance,
    SchedulerConformance,
    StructuredOutputBackendConformance,
    ToolParserConformance,
    WeightFormatConformance,
)
from vlite.testing.conformance import CONFORMANCE_SUITES

BUILTINS = PluginRegistry(build_plugin_manager(load_entry_points=False))


def builtin_names(kind: str) -> list[str]:
    names = BUILTINS.names(kind)
    assert names, f"no built-in {kind} is registered"
    return names


class TestBuiltinSchedulers(SchedulerConformance):
    load_entry_points = False

    @pytest.fixture(scope="class", params=builtin_names("scheduler"))
    @classmethod
    def conformance_plugin_name(cls, request) -> str:
        return request.param


class TestBuiltinAttentionBackends(AttentionBackendConformance):
    load_entry_points = False

    @pytest.fixture(scope="class", params=builtin_names("attention_backend"))
    @classmethod
    def conformance_plugin_name(cls, request) -> str:
        return request.param


class TestBuiltinSamplers(SamplerConformance):
    load_entry_points = False

    @pytest.fixture(scope="class", params=builtin_names("sampler"))
    @classmethod
    def conformance_plugin_name(cls, request) -> str:
        return request.param


def executor_params() -> list:
    """Every built-in executor; ``ray``'s runs are slow (actors start a Python each)."""
    return [
        pytest.param(name, marks=pytest.mark.slow) if name == "ray" else name
        for name in builtin_names("executor")
    ]


@contextlib.contextmanager
def small_local_ray() -> Iterator[None]:
    """A local Ray instance sized for tests, shared by one executor's runs (skipped when Ray
    is not installed: it is the optional extra ``vlite[ray]``)."""
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=80 << 20, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


class TestBuiltinExecutors(ExecutorConformance):
    load_entry_points = False

    @pytest.fixture(scope="class", params=executor_params())
    @classmethod
    def conformance_plugin_name(cls, request) -> Iterator[str]:
        if request.param != "ray":
            yield request.param
            return
        with small_local_ray():  # else every engine would start (and stop) its own
            yield request.param


class TestBuiltinStructuredOutputBackends(StructuredOutputBackendConformance):
    load_entry_points = False

    @pytest.fixture(scope="class", params=builtin_names("structured_output_backend"))
    @classmethod
    def conformance_plugin_name(cls, request) -> str:
        return request.param


class TestBuiltinLogitsProcessors(LogitsProcessorConformance):
    """With each processor's own examples (``tests/plugins/logits_processors`` also runs
    each with the other built-ins' requests as ones it must leave alone)."""

    load_entry_points = False

    @pytest.fixture(scope="class", params=builtin_names("logits_processor"))
    @classmethod
    def conformance_plugin_name(cls, request) -> str:
        return request.param


class TestBuiltinWeightFormats(WeightFormatConformance):
    load_entry_points = False

    @pytest.fixture(scope="class", params=builtin_names("weight_format"))
    @classmethod
    def conformance_plugin_name(cls, request) -> str:
        return request.param


def engine_proposer_names() -> list[str]:
    """The built-in proposers the suite asks directly: a worker proposer's drafts come from
    the workers' draft model (tests/e2e/test_draft_model.py checks ``draft_model``)."""
    return [
        name
        for name in builtin_names("proposer")
        if not issubclass(BUILTINS.get("proposer", name), WorkerProposer)
    ]


class TestBuiltinProposers(ProposerConformance):
    load_entry_points = False

    @pytest.fixture(scope="class", params=engine_proposer_names())
    @classmethod
    def conformance_plugin_name(cls, request) -> str:
        return request.param


class TestBuiltinToolParsers(ToolParserConformance):
    """Each on the golden outputs of its own class."""

    load_entry_points = False

    @pytest.fixture(scope="class", params=builtin_names("tool_parser"))
    @classmethod
    def conformance_plugin_name(cls, request) -> str:
        return request.param


class TestBuiltinReasoningParsers(ReasoningParserConformance):
    """Each on the golden outputs of its own class."""

    load_entry_points = False

    @pytest.fixture(scope="class", params=builtin_names("reasoning_parser"))
    @classmethod
    def conformance_plugin_name(cls, request) -> str:
        return request.param


def model_params() -> list:
    """Every built-in architecture; all but Llama's are ``slow`` (the oracle,
    ``tests/e2e/test_oracle.py``, holds each to transformers at more lengths)."""
    return [
        name if name == "LlamaForCausalLM" else pytest.param(name, marks=pytest.mark.slow)
        for name in builtin_names("model")
    ]


class TestBuiltinModels(ModelConformance):
    load_entry_points = False

    @pytest.fixture(scope="class", params=model_params())
    @classmethod
    def conformance_plugin_name(cls, request) -> str:
        return request.param


TESTED_KINDS = {
    cls.plugin_kind
    for cls in (
        TestBuiltinSchedulers,
        TestBuiltinAttentionBackends,
        TestBuiltinSamplers,
        TestBuiltinExecutors,
        TestBuiltinStructuredOutputBackends,
        TestBuiltinLogitsProcessors,
        TestBuiltinWeightFormats,
        TestBuiltinProposers,
        TestBuiltinToolParsers,
        TestBuiltinReasoningParsers,
        TestBuiltinModels,
    )
}


def test_every_plugin_kind_has_a_suite_run_here():
    assert set(CONFORMANCE_SUITES) == set(PLUGIN_KINDS)
    assert set(CONFORMANCE_SUITES) == TESTED_KINDS


def test_suites_are_not_collected_as_tests_themselves():
    for path in CONFORMANCE_SUITES.values():
        assert not path.rsplit(".", 1)[1].startswith("Test")
