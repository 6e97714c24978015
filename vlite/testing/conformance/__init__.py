"""The plugin conformance suites: pytest base classes a plugin's tests subclass.

``CONFORMANCE_SUITES`` maps a plugin kind to the dotted path of its suite class (from
:data:`vlite.core.plugin_kinds.KINDS`); ``vlite plugins check`` uses it.
"""

from __future__ import annotations

from vlite.core.plugin_kinds import KINDS

CONFORMANCE_SUITES: dict[str, str] = {kind.name: kind.suite for kind in KINDS}
