"""The backend suite on a backend that takes one constraint kind: rollback and row isolation
still run (on its kind), and the kinds it does not claim are refused naming it."""

from __future__ import annotations

import pytest

from vlite.plugins.structured_outputs.xgrammar_backend import XGrammarBackend
from vlite.testing import StructuredOutputBackendConformance
from vlite.testing.conformance.structured_output import LANGUAGE_SPECS


class ChoiceOnlyBackend(XGrammarBackend):
    supported_kinds = ("choice",)


class TestAChoiceOnlyBackend(StructuredOutputBackendConformance):
    plugin_name = "xgrammar"
    load_entry_points = False

    @pytest.fixture(scope="class")
    @classmethod
    def plugin_cls(cls, plugin_entry) -> type:
        return ChoiceOnlyBackend


def test_a_choice_only_backend_walks_its_own_kind():
    """The suite's rollback and row tests take the backend's kind where it has no JSON."""
    assert StructuredOutputBackendConformance.richest_constraint(ChoiceOnlyBackend) == (
        "choice",
        LANGUAGE_SPECS["choice"],
    )
