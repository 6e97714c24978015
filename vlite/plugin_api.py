"""The plugin API surface: every object ``docs/plugins.md`` offers plugin authors, in one list.

:data:`SURFACE` names them; :func:`describe_surface` gives each one's shape (a function's
signature; a class's public methods with their signatures, its fields and attributes), which
vlite's tests compare with the shape recorded for the current
:data:`~vlite.core.hookspecs.PLUGIN_API_VERSION` (``tests/plugin_api/surface_api_N.json``).
A change to the shape is therefore a plugin-API version step, recorded with
``python -m vlite.plugin_api > tests/plugin_api/surface_api_N.json``.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import json
import sys
from typing import Any

#: Every object the plugin docs offer, by dotted path.
SURFACE: tuple[str, ...] = (
    # Loading plugins and the API version.
    "vlite.hookimpl",
    "vlite.PLUGIN_API_VERSION",
    "vlite.core.hookspecs",
    "vlite.core.hookspecs.SUPPORTED_PLUGIN_APIS",
    "vlite.core.plugins.build_plugin_manager",
    "vlite.core.plugins.PluginRegistry",
    "vlite.core.plugins.api_requirement_allows",
    "vlite.core.plugins.parse_api_requirement",
    # The interfaces of the plugin kinds, and what they receive.
    "vlite.core.scheduling_policy.SchedulingPolicy",
    "vlite.core.scheduler.Scheduler",
    "vlite.core.scheduler.SchedulerLimits",
    "vlite.core.request.Request",
    "vlite.core.outputs.SchedulerOutput",
    "vlite.core.outputs.NewRequestData",
    "vlite.core.outputs.CachedRequestData",
    "vlite.core.attention.AttentionBackend",
    "vlite.core.attention.AttentionMetadata",
    "vlite.core.sampler.Sampler",
    "vlite.core.executor.Executor",
    "vlite.core.model.CausalLM",
    "vlite.core.model.ModelDescription",
    "vlite.core.structured_output.StructuredOutputBackend",
    "vlite.core.structured_output.allocate_bitmask",
    "vlite.core.structured_output.allowed_tokens",
    "vlite.core.structured_output_params.StructuredOutputsParams",
    "vlite.core.logits_processor.LogitsProcessor",
    "vlite.core.logits_processor.AddedRequest",
    "vlite.core.weight_format.WeightFormat",
    "vlite.core.weight_format.QuantizedWeight",
    "vlite.core.weight_format.registered_weight_formats",
    "vlite.core.proposer.Proposer",
    "vlite.core.proposer.DraftRequest",
    "vlite.core.proposer.SpeculativeConfig",
    "vlite.core.tool_parser.ToolParser",
    "vlite.core.tool_parser.ToolParserExample",
    "vlite.core.tool_parser.ContentDelta",
    "vlite.core.tool_parser.ToolCallStart",
    "vlite.core.tool_parser.ArgumentsDelta",
    "vlite.core.tool_parser.ToolParseResult",
    "vlite.core.tool_parser.ParsedToolCall",
    "vlite.core.tool_parser.join_events",
    "vlite.core.tool_parser.partial_marker_length",
    "vlite.core.tool_parser.new_tool_call_id",
    "vlite.core.reasoning_parser.ReasoningParser",
    "vlite.core.reasoning_parser.ReasoningParserExample",
    "vlite.core.reasoning_parser.ReasoningDelta",
    "vlite.core.reasoning_parser.AnswerDelta",
    "vlite.core.reasoning_parser.ReasoningParseResult",
    "vlite.core.reasoning_parser.join_reasoning_events",
    "vlite.core.sampling_params.SamplingParams",
    "vlite.core.config.VliteConfig",
    "vlite.core.errors.ConfigError",
    "vlite.core.errors.PluginError",
    "vlite.core.errors.ExecutorFailedError",
    "vlite.core.weight_format.WeightFormatError",
    # Building on the built-in models.
    "vlite.models.llama.LlamaForCausalLM",
    # Testing helpers and the conformance suites.
    "vlite.testing.SchedulerConformance",
    "vlite.testing.AttentionBackendConformance",
    "vlite.testing.SamplerConformance",
    "vlite.testing.ExecutorConformance",
    "vlite.testing.StructuredOutputBackendConformance",
    "vlite.testing.LogitsProcessorConformance",
    "vlite.testing.WeightFormatConformance",
    "vlite.testing.ModelConformance",
    "vlite.testing.ProposerConformance",
    "vlite.testing.ToolParserConformance",
    "vlite.testing.ReasoningParserConformance",
    "vlite.testing.tiny_models.make_tiny_model",
    "vlite.testing.engine_runs.cached_tiny_model",
    "vlite.testing.engine_runs.transformers_greedy",
    "vlite.testing.scheduler_driver.SchedulerDriver",
    "vlite.testing.attention_cases.run_case",
    "vlite.testing.fake_dist.write_plugin_distribution",
    "vlite.testing.conformance.sampler.make_sampling_metadata",
)


def resolve(path: str) -> Any:
    """The object a dotted path names (a module, or an attribute of one)."""
    try:
        return importlib.import_module(path)
    except ModuleNotFoundError:
        module, name = path.rsplit(".", 1)
        return getattr(resolve(module), name)


def describe_surface() -> dict[str, Any]:
    """Each :data:`SURFACE` entry's shape, as JSON-ready data."""
    return {path: _describe(resolve(path)) for path in SURFACE}


def _describe(obj: Any) -> Any:
    if inspect.ismodule(obj):  # the hook specs
        return {
            name: _signature(function)
            for name, function in sorted(vars(obj).items())
            if inspect.isfunction(function) and name.startswith("register_")
        }
    if inspect.isclass(obj):
        return _describe_class(obj)
    if callable(obj):
        return _signature(obj)
    return repr(obj)


def _describe_class(cls: type) -> dict[str, Any]:
    """A class's bases, fields and public members (its own and inherited from vlite)."""
    members: dict[str, Any] = {}
    for klass in reversed(cls.__mro__):
        if not klass.__module__.startswith("vlite"):
            continue
        for name, value in vars(klass).items():
            if name.startswith("_") and name != "__init__":
                continue
            if name.startswith("test_"):  # a suite's checks grow freely; its settings are API
                continue
            members[name] = _member(value)
    shape: dict[str, Any] = {
        "bases": [f"{base.__module__}.{base.__qualname__}" for base in cls.__bases__],
        "members": dict(sorted(members.items())),
    }
    if dataclasses.is_dataclass(cls):
        shape["fields"] = [field.name for field in dataclasses.fields(cls)]
    elif hasattr(cls, "__struct_fields__"):
        shape["fields"] = list(cls.__struct_fields__)
    elif hasattr(cls, "model_fields"):
        shape["fields"] = sorted(cls.model_fields)
    return shape


def _member(value: Any) -> str:
    if isinstance(value, (staticmethod, classmethod)):
        return f"{type(value).__name__} {_signature(value.__func__)}"
    if isinstance(value, property):
        return "property"
    if inspect.isfunction(value):
        return _signature(value)
    return "attribute"


def _signature(function: Any) -> str:
    try:
        return str(inspect.signature(function))
    except (TypeError, ValueError):
        return "(...)"


if __name__ == "__main__":
    json.dump(describe_surface(), sys.stdout, indent=1, sort_keys=True)
    sys.stdout.write("\n")
