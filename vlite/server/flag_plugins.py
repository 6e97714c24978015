"""The plugins ``vlite serve`` flags name (``--tool-call-parser``, ``--reasoning-parser``):
looked up once, refused with the flag and the registered names when unknown."""

from __future__ import annotations

from vlite.core.errors import ConfigError
from vlite.core.plugins import PluginRegistry, build_plugin_manager


def plugin_named_by_flag(
    kind: str, flag: str, name: str, registry: PluginRegistry | None = None
) -> type:
    """The ``kind`` plugin registered as ``name`` (``registry``: default, every installed
    plugin).

    Raises:
        ConfigError: none has that name; the message names ``flag`` and lists the
            registered ones.
    """
    registry = registry or PluginRegistry(build_plugin_manager())
    names = registry.names(kind)
    if name not in names:
        raise ConfigError(
            f"{flag} {name!r} is not a registered {kind.replace('_', ' ')}; registered: "
            f"{', '.join(names) or '(none)'}"
        )
    return registry.get(kind, name)
