"""Fixtures for plugin tests: installed-looking plugin packages and a tiny model."""

from __future__ import annotations

import itertools
import os
import sys
from collections.abc import Callable

import pytest

from vlite.testing.engine_runs import cached_tiny_model
from vlite.testing.fake_dist import write_plugin_distribution

_module_numbers = itertools.count()


@pytest.fixture
def install_plugin(tmp_path, monkeypatch) -> Callable[..., str]:
    """``install_plugin(dist_name, source, version="1.0", entry_name=None)`` -> module name.

    Writes a one-module plugin package whose ``vlite`` entry point (named ``entry_name``, by
    default the module name) loads the module, and puts it on ``sys.path`` and
    ``PYTHONPATH`` (for subprocesses). Each call gets a fresh module name.
    """
    module_names: list[str] = []

    def install(
        dist_name: str, source: str, version: str = "1.0", entry_name: str | None = None
    ) -> str:
        module_name = f"fake_vlite_plugin_{next(_module_numbers)}"
        root = tmp_path / module_name
        write_plugin_distribution(
            root,
            dist_name,
            {module_name: source},
            {entry_name or module_name: module_name},
            version=version,
        )
        monkeypatch.syspath_prepend(str(root))
        inherited = [os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []
        monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(root), *inherited]))
        module_names.append(module_name)
        return module_name

    yield install
    for module_name in module_names:
        sys.modules.pop(module_name, None)


@pytest.fixture(scope="session")
def tiny_model() -> str:
    return str(cached_tiny_model("LlamaForCausalLM"))
