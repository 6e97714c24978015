"""The core (vlite/core) imports nothing above it and names no module above it."""

from __future__ import annotations

import re
from pathlib import Path

import vlite.core

# An import of a layer above the core, the package root, or a module path above it as a
# string (a built-in plugin list in the core would be one).
ABOVE = re.compile(
    r"^\s*(from|import) vlite\.(models|engine|server|cli|plugins|worker|kernels)"
    r"|^\s*from vlite import"
    r"|[\"']vlite\.(plugins|models|engine|server|cli|worker|kernels)\.",
    re.MULTILINE,
)


def test_no_core_module_reaches_above_the_core():
    core = Path(vlite.core.__file__).parent
    offenders = [
        f"{path.name}:{source[: match.start()].count(chr(10)) + 1}: {match.group(0).strip()}"
        for path in sorted(core.glob("*.py"))
        for source in [path.read_text()]
        for match in ABOVE.finditer(source)
    ]
    assert offenders == []
