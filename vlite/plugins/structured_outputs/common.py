"""What the built-in structured-output backends share: the error text they report."""

from __future__ import annotations

import re

# Compiler messages start with a timestamp and a C++ source location: not for users.
_SOURCE_PREFIX = re.compile(r"^\s*(\[[\d:]+\]\s*)?(\S+\.(cc|cpp|rs):\d+:\s*)?")
#: The longest reason quoted from a compiler.
MAX_REASON_CHARS = 400


def compile_error(params_kind: str, backend: str, exc: BaseException) -> ValueError:
    """A ``ValueError`` naming the constraint kind and the compiler's reason (on one line)."""
    reason = " ".join(_SOURCE_PREFIX.sub("", str(exc)).split())[:MAX_REASON_CHARS]
    return ValueError(f"invalid {params_kind} constraint for {backend}: {reason or repr(exc)}")
