"""docs/models.md's runnable examples run (a block marked "(abridged)" is an excerpt)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[2] / "docs" / "models.md"


def runnable_examples() -> list[tuple[int, str]]:
    text = DOC.read_text()
    examples = []
    for match in re.finditer(r"^```python\n(.*?)^```", text, re.S | re.M):
        code = match.group(1)
        if "(abridged)" not in code.splitlines()[0]:
            examples.append((text.count("\n", 0, match.start()) + 1, code))
    return examples


def test_there_is_a_runnable_example():
    assert runnable_examples()


@pytest.mark.parametrize("example", runnable_examples(), ids=lambda e: f"line-{e[0]}")
def test_every_runnable_example_runs(example):
    line, code = example
    exec(compile("\n" * (line) + code, str(DOC), "exec"), {"__name__": "docs_example"})
