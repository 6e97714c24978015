"""Plugins written for earlier plugin APIs keep working: each frozen copy of the example
plugin package (``api_N/``, see README.md) runs its own tests against this vlite, installed
the way pip would install it (a distribution with the ``vlite`` entry point)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from vlite.testing.fake_dist import write_plugin_distribution

HERE = Path(__file__).parent
FROZEN = sorted(path.name for path in HERE.glob("api_*") if path.is_dir())


def install_frozen_copy(frozen: Path, root: Path) -> Path:
    """``root`` holding the frozen package as the installed ``vlite-plugin-example`` 0.1.0
    (put first on the path, it shadows an installed copy of the current example), and its
    tests with a pytest configuration of their own."""
    site = root / "site"
    write_plugin_distribution(
        site, "vlite-plugin-example", {}, {"example": "vlite_plugin_example"}, "0.1.0"
    )
    shutil.copytree(frozen / "vlite_plugin_example", site / "vlite_plugin_example")
    shutil.copytree(frozen / "example_tests", root / "tests")
    (root / "pytest.ini").write_text("[pytest]\n")
    return site


def test_there_is_a_frozen_copy_of_the_plugin_api_before_the_current_one():
    from vlite import PLUGIN_API_VERSION

    assert FROZEN, "no frozen plugin copies"
    assert f"api_{PLUGIN_API_VERSION - 1}" in FROZEN or f"api_{PLUGIN_API_VERSION}" in FROZEN


@pytest.mark.parametrize("api", FROZEN)
def test_a_frozen_example_plugin_passes_its_own_tests(api, tmp_path):
    site = install_frozen_copy(HERE / api, tmp_path)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), *sys.path])}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert " passed" in result.stdout and " failed" not in result.stdout
