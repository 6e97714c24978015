"""The plugin kinds: for each, the hook that registers it, the interface a registered class
implements, and the conformance suite that proves it.

This is the one list of kinds; the registry (:mod:`vlite.core.plugins`), the registration
check and ``vlite plugins check`` (:mod:`vlite.testing.conformance`) read it.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class PluginKind:
    """One kind of plugin.

    Attributes:
        name: the kind, as ``PluginRegistry.get(kind, name)`` takes it.
        hook: the registration hook that fills it (``register_schedulers``).
        interface: the dotted path of the class in ``vlite.core`` a plugin of this kind
            subclasses (``subclassed``) or whose methods it has (a protocol).
        required_methods: the methods a registered class must have (for a protocol).
        subclassed: whether a registered class must subclass ``interface``.
        suite: the dotted path of the kind's conformance suite in ``vlite.testing`` (named,
            not imported: the core imports nothing above it).
    """

    name: str
    hook: str
    interface: str
    suite: str
    required_methods: tuple[str, ...] = ()
    subclassed: bool = False

    def interface_class(self) -> type:
        """The class ``interface`` names."""
        module, name = self.interface.rsplit(".", 1)
        return getattr(importlib.import_module(module), name)


_SUITES = "vlite.testing.conformance"

#: Every plugin kind, in the order the docs list them.
KINDS: tuple[PluginKind, ...] = (
    PluginKind(
        "scheduler",
        "register_schedulers",
        "vlite.core.scheduling_policy.SchedulingPolicy",
        f"{_SUITES}.scheduler.SchedulerConformance",
        subclassed=True,
    ),
    PluginKind(
        "attention_backend",
        "register_attention_backends",
        "vlite.core.attention.AttentionBackend",
        f"{_SUITES}.attention.AttentionBackendConformance",
        subclassed=True,
    ),
    PluginKind(
        "sampler",
        "register_samplers",
        "vlite.core.sampler.Sampler",
        f"{_SUITES}.sampler.SamplerConformance",
        required_methods=("sample",),
    ),
    PluginKind(
        "executor",
        "register_executors",
        "vlite.core.executor.Executor",
        f"{_SUITES}.executor.ExecutorConformance",
        subclassed=True,
    ),
    PluginKind(
        "model",
        "register_models",
        "vlite.core.model.CausalLM",
        f"{_SUITES}.model.ModelConformance",
        required_methods=("forward", "compute_logits", "load_weights"),
    ),
    PluginKind(
        "structured_output_backend",
        "register_structured_output_backends",
        "vlite.core.structured_output.StructuredOutputBackend",
        f"{_SUITES}.structured_output.StructuredOutputBackendConformance",
        required_methods=("validate", "compile"),
    ),
    PluginKind(
        "logits_processor",
        "register_logits_processors",
        "vlite.core.logits_processor.LogitsProcessor",
        f"{_SUITES}.logits_processor.LogitsProcessorConformance",
        required_methods=("update_state", "apply"),
    ),
    PluginKind(
        "proposer",
        "register_proposers",
        "vlite.core.proposer.Proposer",
        f"{_SUITES}.proposer.ProposerConformance",
        subclassed=True,
    ),
    PluginKind(
        "weight_format",
        "register_weight_formats",
        "vlite.core.weight_format.WeightFormat",
        f"{_SUITES}.weight_format.WeightFormatConformance",
        subclassed=True,
    ),
    PluginKind(
        "tool_parser",
        "register_tool_parsers",
        "vlite.core.tool_parser.ToolParser",
        f"{_SUITES}.tool_parser.ToolParserConformance",
        subclassed=True,
    ),
    PluginKind(
        "reasoning_parser",
        "register_reasoning_parsers",
        "vlite.core.reasoning_parser.ReasoningParser",
        f"{_SUITES}.reasoning_parser.ReasoningParserConformance",
        subclassed=True,
    ),
)

#: Kind name -> its descriptor.
KINDS_BY_NAME: dict[str, PluginKind] = {kind.name: kind for kind in KINDS}
