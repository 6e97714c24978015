"""Tools for testing vlite and vlite plugins (shipped in the wheel).

The conformance suites are pytest base classes; a plugin author subclasses one and names
the plugin::

    from vlite.testing import SchedulerConformance

    class TestShortestPromptFirst(SchedulerConformance):
        plugin_name = "shortest-prompt-first"

- :class:`SchedulerConformance`: limits, completion, preemption, block leaks, abort, tokens;
- :class:`AttentionBackendConformance`: dense reference on random shapes, end-to-end tokens;
- :class:`SamplerConformance`: greedy, seeds, top-k/top-p/temperature, shapes and dtypes;
- :class:`ExecutorConformance`: tokens equal ``uniproc``'s, shutdown, crashed workers;
- :class:`StructuredOutputBackendConformance`: the structured-output backend contract;
- :class:`LogitsProcessorConformance`: untouched rows, batch invariance, state that
  follows the batch, no tensor work for steps that do not use it;
- :class:`WeightFormatConformance`: products, gathers and tensor-parallel cuts against the
  format's own dequantized values, refusals that name the type;
- :class:`ModelConformance`: greedy tokens and logprobs of a tiny model of the
  architecture equal ``transformers``' alone, batched, with prefix-cache hits, under
  preemption and at tensor-parallel size 2;
- :class:`ProposerConformance`: drafts of the right form for the requests asked, within
  their ``max_drafts``, deterministic and independent of the batch, a long context answered;
- :class:`ToolParserConformance`: golden outputs parsed to their content and calls, and
  streamed to the same however the text is cut (whole, by character, at every split point,
  in seeded random chunkings), cut-off outputs and calls of functions not offered as content;
- :class:`ReasoningParserConformance`: golden outputs split into their reasoning and answer,
  and streamed to the same however the text is cut, reasoning always before the answer,
  nothing invented, cut-off outputs read without an error.

They need pytest, so they are imported lazily: ``vlite.testing.tiny_models`` and the other
helpers work without it. Under pytest, the suites' modules are registered for pytest's
assertion rewriting before any is imported, so a failed check shows the values compared.
"""

from __future__ import annotations

import sys
from typing import Any

#: Modules whose ``assert`` statements are the suites' checks.
_CHECK_MODULES = ("vlite.testing.conformance", "vlite.testing.scheduler_driver")

if "pytest" in sys.modules:  # running under pytest (vlite.testing is imported first)
    sys.modules["pytest"].register_assert_rewrite(*_CHECK_MODULES)

_LAZY = {
    "PluginConformance": "vlite.testing.conformance.base",
    "SchedulerConformance": "vlite.testing.conformance.scheduler",
    "AttentionBackendConformance": "vlite.testing.conformance.attention",
    "SamplerConformance": "vlite.testing.conformance.sampler",
    "ExecutorConformance": "vlite.testing.conformance.executor",
    "StructuredOutputBackendConformance": "vlite.testing.conformance.structured_output",
    "LogitsProcessorConformance": "vlite.testing.conformance.logits_processor",
    "WeightFormatConformance": "vlite.testing.conformance.weight_format",
    "ModelConformance": "vlite.testing.conformance.model",
    "ProposerConformance": "vlite.testing.conformance.proposer",
    "ToolParserConformance": "vlite.testing.conformance.tool_parser",
    "ReasoningParserConformance": "vlite.testing.conformance.reasoning_parser",
    "CONFORMANCE_SUITES": "vlite.testing.conformance",
    "make_tiny_model": "vlite.testing.tiny_models",
}


def __getattr__(name: str) -> Any:
    module_name = _LAZY.get(name)
    if module_name is None:
        raise AttributeError(f"module 'vlite.testing' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module_name), name)


__all__ = sorted(_LAZY)
