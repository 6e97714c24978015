"""The one list of plugin kinds: each names a hook pluggy knows, an interface in the core
and a conformance suite that exists and tests that kind."""

from __future__ import annotations

import importlib

import pytest

from vlite.core import hookspecs
from vlite.core.plugin_kinds import KINDS
from vlite.core.plugins import PLUGIN_KINDS, registration_problem


@pytest.mark.parametrize("kind", KINDS, ids=lambda kind: kind.name)
def test_each_kind_names_a_hook_an_interface_and_its_suite(kind):
    assert callable(getattr(hookspecs, kind.hook, None)), kind.hook
    assert kind.interface.startswith("vlite.core.")
    interface = kind.interface_class()
    for method in kind.required_methods:
        assert callable(getattr(interface, method, None)), (kind.name, method)
    module, name = kind.suite.rsplit(".", 1)
    suite = getattr(importlib.import_module(module), name)
    assert suite.plugin_kind == kind.name


def test_the_registry_and_the_check_read_the_same_list():
    assert {kind.name: kind.hook for kind in KINDS} == PLUGIN_KINDS


@pytest.mark.parametrize("kind", [k for k in KINDS if k.subclassed], ids=lambda k: k.name)
def test_a_class_that_does_not_subclass_the_interface_is_refused_naming_it(kind):
    class Unrelated:
        pass

    assert registration_problem(kind.name, Unrelated) == f"does not subclass {kind.interface}"


@pytest.mark.parametrize("kind", [k for k in KINDS if k.required_methods], ids=lambda k: k.name)
def test_a_class_without_the_protocols_methods_is_refused_naming_them(kind):
    class Empty:
        pass

    problem = registration_problem(kind.name, Empty)
    assert problem == f"has no {', '.join(kind.required_methods)} method"
