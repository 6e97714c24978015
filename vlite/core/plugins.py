"""Plugin manager factory and the registry of named plugin classes.

Built-in plugins are modules listed in :data:`BUILTIN_PLUGINS`, registered through the
same hooks as third-party ones; third-party plugins come from the ``vlite`` entry-point
group. Every engine builds its own manager with :func:`build_plugin_manager` and reads
the classes it needs from a :class:`PluginRegistry` once, at construction.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from importlib import metadata
from typing import Any

import pluggy

from vlite.core import hookspecs

#: Modules whose hook implementations ship with vlite.
BUILTIN_PLUGINS: tuple[str, ...] = (
    "vlite.plugins.schedulers.fcfs",
    "vlite.plugins.attention.torch_ref",
    "vlite.plugins.samplers.default",
    "vlite.plugins.executors.uniproc",
    "vlite.models.llama",
)

ENTRY_POINT_GROUP = "vlite"
ALLOW_LIST_ENV = "VLITE_PLUGINS"

#: Plugin kind -> the registration hook that fills it.
PLUGIN_KINDS: dict[str, str] = {
    "scheduler": "register_schedulers",
    "attention_backend": "register_attention_backends",
    "sampler": "register_samplers",
    "executor": "register_executors",
    "model": "register_models",
}


class PluginError(RuntimeError):
    """A plugin failed to load or registered something invalid."""


@dataclass(frozen=True)
class PluginEntry:
    """One registered class and where it came from."""

    kind: str
    name: str
    obj: Any
    plugin_name: str
    package: str
    version: str


class VlitePluginManager(pluggy.PluginManager):
    """A pluggy manager that remembers which package provided each plugin."""

    def __init__(self) -> None:
        super().__init__(hookspecs.PROJECT_NAME)
        self.add_hookspecs(hookspecs)
        self.origins: dict[str, tuple[str, str]] = {}

    def origin_of(self, plugin_name: str) -> tuple[str, str]:
        """(package, version) that provides a registered plugin."""
        return self.origins.get(plugin_name, ("(not installed)", ""))


def build_plugin_manager(
    extra_plugins: tuple[Any, ...] = (), load_entry_points: bool = True
) -> VlitePluginManager:
    """A fresh manager with vlite's hookspecs, the built-ins, and installed plugins.

    ``extra_plugins`` (modules or objects with hook implementations) are registered too;
    tests use this to add a plugin without installing a package.
    """
    from vlite import __version__

    pm = VlitePluginManager()
    for module_name in BUILTIN_PLUGINS:
        pm.register(importlib.import_module(module_name), name=module_name)
        pm.origins[module_name] = ("vlite", __version__)
    if load_entry_points:
        _load_entry_points(pm)
    for plugin in extra_plugins:
        pm.register(plugin)
    pm.check_pending()
    return pm


def _allowed_plugin_names() -> set[str] | None:
    raw = os.environ.get(ALLOW_LIST_ENV)
    if raw is None:
        return None
    return {name.strip() for name in raw.split(",") if name.strip()}


def _load_entry_points(pm: VlitePluginManager) -> None:
    allowed = _allowed_plugin_names()
    for entry_point in metadata.entry_points(group=ENTRY_POINT_GROUP):
        if allowed is not None and entry_point.name not in allowed:
            continue
        if pm.get_plugin(entry_point.name) is not None:
            continue
        package = _describe_distribution(entry_point)
        try:
            plugin = entry_point.load()
        except Exception as exc:
            raise PluginError(
                f"plugin {entry_point.name!r} from {package} failed to load "
                f"({entry_point.value}): {type(exc).__name__}: {exc}"
            ) from exc
        pm.register(plugin, name=entry_point.name)
        dist = entry_point.dist
        if dist is not None:
            pm.origins[entry_point.name] = (dist.name, dist.version)


def _describe_distribution(entry_point: metadata.EntryPoint) -> str:
    dist = entry_point.dist
    if dist is None:
        return "an unknown package"
    return f"package {dist.name} {dist.version}"


class PluginRegistry:
    """Every class the plugins registered, by kind and name."""

    def __init__(self, pm: VlitePluginManager) -> None:
        self._entries: dict[str, dict[str, PluginEntry]] = {kind: {} for kind in PLUGIN_KINDS}
        for kind, hook_name in PLUGIN_KINDS.items():
            for impl in getattr(pm.hook, hook_name).get_hookimpls():
                impl.function(register=self._register_callback(pm, kind, impl.plugin_name))

    def _register_callback(self, pm: VlitePluginManager, kind: str, plugin_name: str):
        package, version = pm.origin_of(plugin_name)

        def register(name: str, obj: Any) -> None:
            existing = self._entries[kind].get(name)
            if existing is not None:
                raise PluginError(
                    f"{kind} {name!r} is registered twice: by plugin "
                    f"{existing.plugin_name!r} ({existing.package}) and by plugin "
                    f"{plugin_name!r} ({package})"
                )
            self._entries[kind][name] = PluginEntry(kind, name, obj, plugin_name, package, version)

        return register

    def get(self, kind: str, name: str) -> Any:
        """The class registered as ``name``; a ``ValueError`` lists the names available."""
        entry = self._entries[kind].get(name)
        if entry is None:
            available = ", ".join(sorted(self._entries[kind])) or "(none)"
            raise ValueError(f"unknown {kind} {name!r}; available: {available}")
        return entry.obj

    def names(self, kind: str) -> list[str]:
        return sorted(self._entries[kind])

    def entries(self) -> list[PluginEntry]:
        return [entry for by_name in self._entries.values() for entry in by_name.values()]
