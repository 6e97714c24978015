"""What every conformance suite shares: finding the plugin, and capability flags.

A suite is a pytest class that is not collected itself (its name does not start with
``Test``); a plugin's test module subclasses it with a ``Test...`` name and sets
:attr:`PluginConformance.plugin_name`. Fixtures are class-scoped, so each suite builds its
plugin manager and tiny models once.
"""

from __future__ import annotations

from typing import Any, ClassVar

import pytest

from vlite.core.plugins import (
    PluginEntry,
    PluginRegistry,
    VlitePluginManager,
    build_plugin_manager,
    check_plugin_api,
)


class PluginConformance:
    """Base of the suites. Subclasses set :attr:`plugin_name` (and maybe the others).

    Attributes:
        plugin_name: the registry name of the plugin under test (``"sjf"``).
        extra_plugins: modules or objects with hook implementations to register besides
            the installed ones, for a plugin that is not installed as a package.
        load_entry_points: also load installed plugins (the ``vlite`` entry-point group).

    Capability flags (``supports_prefix_caching``, ...) are read from the plugin class, where
    the plugin claims them; a test class may set the same attribute to ``True``/``False``
    to override the claim. Tests of an unclaimed capability are skipped.
    """

    #: The plugin kind the suite tests (a key of ``vlite.core.plugins.PLUGIN_KINDS``).
    plugin_kind: ClassVar[str] = ""
    plugin_name: ClassVar[str | None] = None
    extra_plugins: ClassVar[tuple[Any, ...]] = ()
    load_entry_points: ClassVar[bool] = True
    #: Flag -> what an unset flag means, for the kind (a suite fills this in).
    capability_defaults: ClassVar[dict[str, bool]] = {}

    # ---- finding the plugin ----------------------------------------------------------

    @classmethod
    def build_plugin_manager(cls, *more_plugins: Any) -> VlitePluginManager:
        """A fresh plugin manager: built-ins, installed plugins, :attr:`extra_plugins`."""
        return build_plugin_manager(
            extra_plugins=(*cls.extra_plugins, *more_plugins),
            load_entry_points=cls.load_entry_points,
        )

    @pytest.fixture(scope="class")
    @classmethod
    def conformance_plugin_name(cls) -> str:
        """The name under test; override with a parametrized fixture to test several."""
        if not cls.plugin_name:
            raise pytest.UsageError(
                f"{cls.__name__} must set plugin_name to the registry name of the "
                f"{cls.plugin_kind} under test"
            )
        return cls.plugin_name

    @pytest.fixture(scope="class")
    @classmethod
    def plugin_registry(cls) -> PluginRegistry:
        return PluginRegistry(cls.build_plugin_manager())

    @pytest.fixture(scope="class")
    @classmethod
    def plugin_entry(cls, plugin_registry: PluginRegistry, conformance_plugin_name) -> PluginEntry:
        return plugin_registry.entry(cls.plugin_kind, conformance_plugin_name)

    @pytest.fixture(scope="class")
    @classmethod
    def plugin_cls(cls, plugin_entry: PluginEntry) -> Any:
        return plugin_entry.obj

    # ---- capability flags ------------------------------------------------------------

    def claims(self, plugin_cls: Any, flag: str) -> bool:
        """Whether the plugin claims ``flag`` (the test class's own setting wins)."""
        override = getattr(type(self), flag, None)
        if override is not None:
            return bool(override)
        return bool(getattr(plugin_cls, flag, self.capability_defaults.get(flag, True)))

    def require(self, plugin_cls: Any, flag: str) -> None:
        """Skip the calling test unless the plugin claims ``flag``."""
        if not self.claims(plugin_cls, flag):
            pytest.skip(f"the plugin does not claim {flag}")

    # ---- the first check of every suite ----------------------------------------------

    def check_interface(self, plugin_cls: Any) -> None:
        """Assert that ``plugin_cls`` implements the kind's interface (suites override)."""

    def test_plugin_loads_through_a_fresh_plugin_manager(self, conformance_plugin_name) -> None:
        """The plugin registers through the hooks of a new manager, which validates."""
        pm = self.build_plugin_manager()
        pm.check_pending()
        registry = PluginRegistry(pm)
        entry = registry.entry(self.plugin_kind, conformance_plugin_name)
        plugin = pm.get_plugin(entry.plugin_name)
        assert plugin is not None, f"plugin {entry.plugin_name!r} is not registered"
        check_plugin_api(plugin, entry.plugin_name, entry.package)
        self.check_interface(entry.obj)
        # A second manager gives the same class: registration keeps no global state.
        again = PluginRegistry(self.build_plugin_manager())
        assert again.get(self.plugin_kind, conformance_plugin_name) is entry.obj
