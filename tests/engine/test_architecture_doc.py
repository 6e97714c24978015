"""docs/architecture.md stays true: the files, hooks and suites it names exist."""

from __future__ import annotations

import re
from pathlib import Path

import vlite.testing
from vlite.core import hookspecs

ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "docs" / "architecture.md").read_text()


def test_every_named_file_exists():
    paths = set(re.findall(r"`((?:vlite/|tests/)?[\w/]+\.py)`", DOC))
    assert paths, "the document names no file"
    missing = [
        path
        for path in sorted(paths)
        if not (ROOT / path).exists() and not (ROOT / "vlite" / path).exists()
    ]
    assert missing == []


def test_every_named_hook_and_suite_exists():
    hooks = set(re.findall(r"`(register_\w+)`", DOC))
    suites = set(re.findall(r"`(\w+Conformance)`", DOC))
    assert len(hooks) >= 8 and len(suites) >= 7
    assert [hook for hook in sorted(hooks) if not hasattr(hookspecs, hook)] == []
    assert [suite for suite in sorted(suites) if not hasattr(vlite.testing, suite)] == []
