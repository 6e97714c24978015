"""Plugin manager factory and the registry of named plugin classes.

Built-in plugins are the modules of vlite's own ``vlite.builtin`` entry points
(:func:`builtin_plugin_modules`), registered through the same hooks as third-party ones;
third-party plugins come from the ``vlite`` entry-point group. Every engine builds its own
manager with :func:`build_plugin_manager` and reads the classes it needs from a
:class:`PluginRegistry` once, at construction.

Loading is loud: a plugin that fails to import, fails pluggy's validation, requires another
plugin API version (:func:`check_plugin_api`) or registers a name twice raises
:class:`PluginError` naming the plugin and its package. Commands that only describe vlite
(``vlite --help``, ``vlite plugins list``) pass ``broken=[]`` instead: an installed plugin
that fails to load is then skipped and reported as a :class:`BrokenPlugin`, so one bad
package cannot take the whole CLI down.
"""

from __future__ import annotations

import importlib
import os
import traceback
import warnings
from dataclasses import dataclass
from importlib import metadata
from typing import Any

import pluggy
from packaging.specifiers import InvalidSpecifier, SpecifierSet

from vlite.core import hookspecs
from vlite.core.errors import ConfigError, PluginError
from vlite.core.hookspecs import PLUGIN_API_VERSION, SUPPORTED_PLUGIN_APIS
from vlite.core.plugin_kinds import KINDS, KINDS_BY_NAME

ENTRY_POINT_GROUP = "vlite"
#: Entry-point group, in vlite's own package metadata, of the modules whose hook
#: implementations ship with vlite (``pyproject.toml`` lists them).
BUILTIN_GROUP = "vlite.builtin"
ALLOW_LIST_ENV = "VLITE_PLUGINS"
#: Module-level attribute in which a plugin declares the plugin API versions it supports.
API_REQUIREMENT_ATTRIBUTE = "VLITE_PLUGIN_API"

#: Plugin kind -> the registration hook that fills it (from :data:`~vlite.core.plugin_kinds.KINDS`).
PLUGIN_KINDS: dict[str, str] = {kind.name: kind.hook for kind in KINDS}


def builtin_plugin_modules() -> tuple[str, ...]:
    """The modules of vlite's built-in plugins, from its package metadata.

    Raises:
        PluginError: the metadata lists none (an install from before they were declared
            there): reinstalling vlite writes them.
    """
    modules = tuple(
        entry_point.value
        for entry_point in metadata.entry_points(group=BUILTIN_GROUP)
        if entry_point.dist is None or entry_point.dist.name == "vlite"
    )
    if not modules:
        raise PluginError(
            f"vlite's package metadata declares no built-in plugins (entry-point group "
            f"{BUILTIN_GROUP!r}); reinstall vlite, e.g. pip install -e ."
        )
    return modules


def vlite_version() -> str:
    """The installed vlite's version, from its package metadata (one source: pyproject)."""
    try:
        return metadata.version("vlite")
    except metadata.PackageNotFoundError:
        return "unknown (not installed)"


@dataclass(frozen=True)
class PluginEntry:
    """One registered class and where it came from."""

    kind: str
    name: str
    obj: Any
    plugin_name: str
    package: str
    version: str


@dataclass(frozen=True)
class BrokenPlugin:
    """An installed plugin that failed to load, skipped (see :func:`build_plugin_manager`).

    Attributes:
        name: its entry-point name (what ``VLITE_PLUGINS`` lists).
        error: the loading error, naming plugin and package.
        location: ``file:line`` where it failed inside the plugin's code, if known.
    """

    name: str
    error: str
    location: str | None

    def describe(self) -> str:
        """One line: the error, where it happened, and how to skip the plugin."""
        where = f" (at {self.location})" if self.location else ""
        return (
            f"{self.error}{where}; to skip it, list the plugins to load in "
            f"{ALLOW_LIST_ENV} (e.g. {ALLOW_LIST_ENV}= loads none)"
        )


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
    extra_plugins: tuple[Any, ...] = (),
    load_entry_points: bool = True,
    broken: list[BrokenPlugin] | None = None,
) -> VlitePluginManager:
    """A fresh manager with vlite's hookspecs, the built-ins, and installed plugins.

    ``extra_plugins`` (modules or objects with hook implementations) are registered too;
    tests use this to add a plugin without installing a package. With ``broken`` given, an
    installed plugin that fails to load is left out and appended to it instead of raising.

    Raises:
        PluginError: a plugin failed to import or to validate, or requires a plugin API
            version this vlite does not provide; the message names plugin and package.
    """
    pm = VlitePluginManager()
    builtins, version = builtin_plugin_modules(), vlite_version()
    for module_name in builtins:
        pm.origins[module_name] = ("vlite", version)
        _register(pm, importlib.import_module(module_name), module_name)
    if load_entry_points:
        _load_entry_points(pm, broken)
    for plugin in extra_plugins:
        _register(pm, plugin, None)
    while True:
        try:
            pm.check_pending()
            return pm
        except pluggy.PluginValidationError as exc:
            name = pm.get_name(exc.plugin) or ""
            error = PluginError(
                f"plugin {_label(exc.plugin, name)!r} from {_describe_origin(pm, name)} is "
                f"invalid: {exc}"
            )
            if broken is None or name in builtins or name not in pm.origins:
                raise error from exc
            pm.unregister(exc.plugin)
            broken.append(BrokenPlugin(name, str(error), None))


def _register(pm: VlitePluginManager, plugin: Any, name: str | None) -> None:
    """Check the plugin's API requirement, then register it; errors name plugin and package."""
    label = _label(plugin, name)
    origin = _describe_origin(pm, name or "")
    check_plugin_api(plugin, label, origin)
    try:
        pm.register(plugin, name=name)
    except (pluggy.PluginValidationError, ValueError) as exc:
        raise PluginError(f"plugin {label!r} from {origin} could not be registered: {exc}") from exc


def _label(plugin: Any, name: str | None) -> str:
    """A readable name for messages (pluggy names an unnamed object by its ``id``)."""
    if name and not name.isdigit():
        return name
    return getattr(plugin, "__name__", None) or f"{type(plugin).__qualname__} object"


def _describe_origin(pm: VlitePluginManager, plugin_name: str) -> str:
    if plugin_name not in pm.origins:
        return "no package (registered in code)"
    package, version = pm.origin_of(plugin_name)
    return f"package {package} {version}".rstrip()


def _join(*parts: str) -> str:
    return " ".join(part for part in parts if part)


def _allowed_plugin_names() -> set[str] | None:
    raw = os.environ.get(ALLOW_LIST_ENV)
    if raw is None:
        return None
    return {name.strip() for name in raw.split(",") if name.strip()}


def _load_entry_points(pm: VlitePluginManager, broken: list[BrokenPlugin] | None) -> None:
    allowed = _allowed_plugin_names()
    entry_points = list(metadata.entry_points(group=ENTRY_POINT_GROUP))
    _warn_about_unknown_names(allowed, [entry_point.name for entry_point in entry_points])
    for entry_point in entry_points:
        if allowed is not None and entry_point.name not in allowed:
            continue
        registered_before = pm.get_plugin(entry_point.name) is not None
        try:
            _load_entry_point(pm, entry_point)
        except PluginError as exc:
            if broken is None:
                raise
            if not registered_before and pm.get_plugin(entry_point.name) is not None:
                pm.unregister(name=entry_point.name)  # half-registered: take it out again
            broken.append(BrokenPlugin(entry_point.name, str(exc), _plugin_frame(exc)))


def _warn_about_unknown_names(allowed: set[str] | None, installed: list[str]) -> None:
    """A ``VLITE_PLUGINS`` name that no installed plugin has is most likely a typo."""
    for name in sorted((allowed or set()) - set(installed)):
        warnings.warn(
            f"{ALLOW_LIST_ENV} names {name!r}, which no installed plugin has; installed: "
            f"{', '.join(sorted(installed)) or 'none'}",
            stacklevel=4,
        )


def _plugin_frame(exc: BaseException) -> str | None:
    """``file:line`` of the innermost frame of the error's cause outside vlite's and the
    import system's own code: where the plugin's code failed."""
    cause = exc.__cause__ or exc
    if isinstance(cause, SyntaxError) and cause.filename:
        return f"{cause.filename}:{cause.lineno}"
    frames = [
        frame
        for frame in traceback.extract_tb(cause.__traceback__)
        if not frame.filename.startswith("<")
        and f"{os.sep}vlite{os.sep}core{os.sep}" not in frame.filename
        and f"{os.sep}importlib{os.sep}" not in frame.filename
        and f"{os.sep}pluggy{os.sep}" not in frame.filename
    ]
    return f"{frames[-1].filename}:{frames[-1].lineno}" if frames else None


def _load_entry_point(pm: VlitePluginManager, entry_point: metadata.EntryPoint) -> None:
    package = _describe_distribution(entry_point)
    if pm.get_plugin(entry_point.name) is not None:
        raise PluginError(
            f"plugin name {entry_point.name!r} is used twice: by "
            f"{_describe_origin(pm, entry_point.name)} and by {package}"
        )
    try:
        plugin = entry_point.load()
    except Exception as exc:
        raise PluginError(
            f"plugin {entry_point.name!r} from {package} failed to load "
            f"({entry_point.value}): {type(exc).__name__}: {exc}"
        ) from exc
    dist = entry_point.dist
    if dist is not None:
        pm.origins[entry_point.name] = (dist.name, dist.version)
    _register(pm, plugin, entry_point.name)


def _describe_distribution(entry_point: metadata.EntryPoint) -> str:
    dist = entry_point.dist
    if dist is None:
        return "an unknown package"
    return f"package {dist.name} {dist.version}"


def parse_api_requirement(requirement: int | str) -> SpecifierSet:
    """``VLITE_PLUGIN_API`` as a :class:`packaging.specifiers.SpecifierSet`: ``">=1,<3"`` as
    written, a bare ``N`` (int or string) as ``>=N``.

    Raises:
        ValueError: the requirement is not an int or a version specifier such as ``>=1``.
    """
    if isinstance(requirement, int) and not isinstance(requirement, bool):
        return SpecifierSet(f">={requirement}")
    if not isinstance(requirement, str) or not requirement.strip():
        raise ValueError("expected an int or a string such as '>=1' or '>=1,<3'")
    text = requirement.strip()
    if text.isdigit():
        text = f">={text}"
    try:
        return SpecifierSet(text)
    except InvalidSpecifier:
        raise ValueError(f"cannot parse {requirement!r}; expected e.g. '>=1' or '>=1,<3'") from None


def api_requirement_allows(
    requirement: int | str, versions: int | tuple[int, ...] = SUPPORTED_PLUGIN_APIS
) -> bool:
    """Whether one of the plugin API ``versions`` (by default every version this vlite
    serves) satisfies every clause of ``requirement``."""
    specifier = parse_api_requirement(requirement)
    if isinstance(versions, int):
        versions = (versions,)
    return any(specifier.contains(str(version), prereleases=True) for version in versions)


def check_plugin_api(plugin: Any, plugin_name: str, package: str) -> None:
    """Raise :class:`PluginError` if ``plugin.VLITE_PLUGIN_API`` excludes this vlite's API.

    A plugin without the attribute is assumed to work with every version.
    """
    requirement = getattr(plugin, API_REQUIREMENT_ATTRIBUTE, None)
    if requirement is None:
        return
    try:
        is_allowed = api_requirement_allows(requirement)
    except ValueError as exc:
        raise PluginError(
            f"plugin {plugin_name!r} from {package} declares an invalid "
            f"{API_REQUIREMENT_ATTRIBUTE}={requirement!r}: {exc}"
        ) from None
    if not is_allowed:
        raise PluginError(
            f"plugin {plugin_name!r} from {package} requires vlite plugin API "
            f"{requirement!r}, but vlite {vlite_version()} provides plugin API versions "
            f"{', '.join(map(str, SUPPORTED_PLUGIN_APIS))} (newest {PLUGIN_API_VERSION}); "
            "install a vlite (or a plugin version) that matches"
        )


def registration_problem(kind: str, obj: Any) -> str | None:
    """Why ``obj`` cannot be registered as a ``kind`` (``None``: it can).

    Every kind takes a class (the engine instantiates it); schedulers subclass
    :class:`~vlite.core.scheduling_policy.SchedulingPolicy` (or, plugin API 1,
    :class:`~vlite.core.scheduler.Scheduler` defining both required policy methods),
    attention backends, executors and weight formats subclass the core's base class,
    samplers and models have the methods of their protocol
    (:class:`~vlite.core.sampler.Sampler`, :class:`~vlite.core.model.CausalLM`).
    """
    if not isinstance(obj, type):
        return "is not a class (register the class, not an instance)"
    descriptor = KINDS_BY_NAME[kind]
    interface = descriptor.interface_class()
    if kind == "scheduler":
        from vlite.core.scheduler import Scheduler

        return _scheduler_problem(obj, interface, Scheduler)
    if descriptor.subclassed and not issubclass(obj, interface):
        return f"does not subclass {_qualified(interface)}"
    abstract = sorted(getattr(obj, "__abstractmethods__", ()))
    if kind in ("weight_format", "tool_parser", "reasoning_parser") and abstract:
        return f"does not implement {', '.join(abstract)}"
    missing = [m for m in descriptor.required_methods if not callable(getattr(obj, m, None))]
    if missing:
        return f"has no {', '.join(missing)} method"
    return None


def _scheduler_problem(obj: type, policy_base: type, api1_base: type) -> str | None:
    if issubclass(obj, api1_base):
        required = ("waiting_sort_key", "choose_victim")
        missing = [m for m in required if getattr(obj, m) is getattr(api1_base, m)]
        if missing:
            return f"subclasses {_qualified(api1_base)} without defining {', '.join(missing)}"
        return None
    if not issubclass(obj, policy_base):
        return f"does not subclass {_qualified(policy_base)}"
    return None


def _qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


class PluginRegistry:
    """Every class the plugins registered, by kind and name."""

    def __init__(self, pm: VlitePluginManager) -> None:
        self._entries: dict[str, dict[str, PluginEntry]] = {kind: {} for kind in PLUGIN_KINDS}
        for kind, hook_name in PLUGIN_KINDS.items():
            for impl in getattr(pm.hook, hook_name).get_hookimpls():
                register = self._register_callback(pm, kind, impl.plugin_name)
                try:
                    impl.function(register=register)
                except PluginError:
                    raise
                except Exception as exc:
                    raise PluginError(
                        f"plugin {impl.plugin_name!r} from "
                        f"{_describe_origin(pm, impl.plugin_name)} failed in {hook_name}: "
                        f"{type(exc).__name__}: {exc}"
                    ) from exc

    def _register_callback(self, pm: VlitePluginManager, kind: str, plugin_name: str):
        package, version = pm.origin_of(plugin_name)

        def register(name: str, obj: Any) -> None:
            problem = registration_problem(kind, obj)
            if problem is not None:
                what = f"{obj.__module__}.{obj.__qualname__}" if isinstance(obj, type) else obj
                raise PluginError(
                    f"plugin {plugin_name!r} ({_join(package, version)}) registered {kind} "
                    f"{name!r} as {str(what)[:120]}, which {problem}"
                )
            existing = self._entries[kind].get(name)
            if existing is not None:
                raise PluginError(
                    f"{kind} {name!r} is registered twice: by plugin "
                    f"{existing.plugin_name!r} ({_join(existing.package, existing.version)}) "
                    f"and by plugin {plugin_name!r} ({_join(package, version)})"
                )
            self._entries[kind][name] = PluginEntry(kind, name, obj, plugin_name, package, version)

        return register

    def entry(self, kind: str, name: str) -> PluginEntry:
        """The :class:`PluginEntry` of ``name``; a ``ValueError`` lists the names available."""
        entry = self._entries[kind].get(name)
        if entry is None:
            available = ", ".join(sorted(self._entries[kind])) or "(none)"
            raise ConfigError(f"unknown {kind} {name!r}; available: {available}")
        return entry

    def kinds_of(self, name: str) -> list[str]:
        """Every kind in which ``name`` is registered."""
        return [kind for kind, by_name in self._entries.items() if name in by_name]

    def get(self, kind: str, name: str) -> Any:
        """The class registered as ``name``; a ``ValueError`` lists the names available."""
        return self.entry(kind, name).obj

    def names(self, kind: str) -> list[str]:
        return sorted(self._entries[kind])

    def entries(self) -> list[PluginEntry]:
        return [entry for by_name in self._entries.values() for entry in by_name.values()]
