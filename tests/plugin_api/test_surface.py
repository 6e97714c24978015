"""The plugin API surface (``vlite.plugin_api.SURFACE``) has the shape recorded for the current
plugin API version: changing it is a version step, recorded with its new shape."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import vlite
from vlite.plugin_api import SURFACE, describe_surface, resolve

HERE = Path(__file__).parent
RECORDED = HERE / f"surface_api_{vlite.PLUGIN_API_VERSION}.json"


def differences(recorded: dict, live: dict, path: str = "") -> list[str]:
    """Where two surface descriptions differ, one line each."""
    if isinstance(recorded, dict) and isinstance(live, dict):
        lines = []
        for key in sorted(set(recorded) | set(live)):
            where = f"{path}.{key}" if path else key
            if key not in live:
                lines.append(f"removed: {where}")
            elif key not in recorded:
                lines.append(f"added: {where}")
            else:
                lines += differences(recorded[key], live[key], where)
        return lines
    return [] if recorded == live else [f"changed: {path}: {recorded!r} -> {live!r}"]


def test_the_surface_has_the_shape_recorded_for_this_plugin_api_version():
    assert RECORDED.exists(), f"no recorded surface for plugin API {vlite.PLUGIN_API_VERSION}"
    recorded = json.loads(RECORDED.read_text())
    changes = differences(recorded, json.loads(json.dumps(describe_surface())))
    assert not changes, (
        "the plugin API surface changed:\n  "
        + "\n  ".join(changes[:40])
        + "\nStep vlite.core.hookspecs.PLUGIN_API_VERSION, say what changed in docs/plugins.md "
        "(The plugin API version), freeze the example plugin (tests/plugin_api/README.md) and "
        "record the shape: python -m vlite.plugin_api > tests/plugin_api/surface_api_N.json"
    )


@pytest.mark.parametrize("path", SURFACE)
def test_every_entry_resolves(path):
    assert resolve(path) is not None


def test_the_docs_name_every_module_the_surface_draws_from():
    docs = (HERE.parents[1] / "docs" / "plugins.md").read_text()
    for path in SURFACE:
        name = path.rsplit(".", 1)[-1]
        assert name in docs, f"{path} is in the surface but docs/plugins.md never names it"


def test_a_changed_member_is_reported():
    recorded = {"X": {"members": {"f": "(self, a)"}}}
    live = {"X": {"members": {"f": "(self, a, b)", "g": "property"}}}
    assert differences(recorded, live) == [
        "changed: X.members.f: '(self, a)' -> '(self, a, b)'",
        "added: X.members.g",
    ]


def test_the_module_prints_the_recorded_form():
    printed = subprocess.run(
        [sys.executable, "-m", "vlite.plugin_api"], capture_output=True, text=True, check=True
    ).stdout
    assert json.loads(printed) == json.loads(json.dumps(describe_surface()))
