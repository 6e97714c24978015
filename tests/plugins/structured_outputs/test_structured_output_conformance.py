"""The structured-output conformance suite on both built-in backends."""

from __future__ import annotations

from vlite.testing.conformance.structured_output import StructuredOutputBackendConformance


class TestXGrammar(StructuredOutputBackendConformance):
    plugin_name = "xgrammar"


class TestLLGuidance(StructuredOutputBackendConformance):
    plugin_name = "llguidance"
