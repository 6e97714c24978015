"""Loading third-party plugins through real entry points: loud errors, API versions, allow-list.

Each plugin here is an installed-looking package (a module and a ``.dist-info`` on
``sys.path``), so ``importlib.metadata`` finds it as it would find a pip-installed one.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

import vlite
from vlite import LLM, SamplingParams
from vlite.core.plugins import (
    PluginError,
    PluginRegistry,
    api_requirement_allows,
    build_plugin_manager,
    parse_api_requirement,
)

SCHEDULER_PLUGIN = """
import vlite
from vlite.plugins.schedulers.fcfs import FcfsPolicy

VLITE_PLUGIN_API = {requirement!r}


class NewestFirstPolicy(FcfsPolicy):
    def waiting_sort_key(self, request):
        return (-request.arrival_index,)


@vlite.hookimpl
def register_schedulers(register):
    register({name!r}, NewestFirstPolicy)
"""


def scheduler_plugin(name: str = "newest-first", requirement: object = None) -> str:
    return SCHEDULER_PLUGIN.format(name=name, requirement=requirement)


# ---- errors that fail engine construction, naming the plugin and its package ----------


def test_a_plugin_that_raises_on_import_fails_engine_construction(install_plugin, tiny_model):
    module = install_plugin("exploding-plugin", "raise RuntimeError('boom at import')", "2.3")
    with pytest.raises(PluginError) as info:
        LLM(model=tiny_model)
    message = str(info.value)
    assert f"plugin {module!r}" in message
    assert "package exploding-plugin 2.3" in message
    assert "RuntimeError: boom at import" in message


def test_a_plugin_registering_a_taken_name_fails_engine_construction(install_plugin, tiny_model):
    module = install_plugin("clashing-plugin", scheduler_plugin(name="fcfs"), "0.4")
    with pytest.raises(PluginError) as info:
        LLM(model=tiny_model)
    message = str(info.value)
    assert "scheduler 'fcfs' is registered twice" in message
    assert "'vlite.plugins.schedulers.fcfs' (vlite " in message
    assert f"plugin {module!r} (clashing-plugin 0.4)" in message


def test_two_plugins_registering_the_same_name_fail_naming_both(install_plugin, tiny_model):
    first = install_plugin("first-plugin", scheduler_plugin(name="twin"))
    second = install_plugin("second-plugin", scheduler_plugin(name="twin"))
    with pytest.raises(PluginError) as info:
        LLM(model=tiny_model)
    message = str(info.value)
    assert first in message and second in message
    assert "first-plugin 1.0" in message and "second-plugin 1.0" in message


#: The plugin API version after this vlite's newest.
NEXT_API = vlite.PLUGIN_API_VERSION + 1


@pytest.mark.parametrize("requirement", [f">={NEXT_API}", str(NEXT_API), NEXT_API, ">=1,<1", "==0"])
def test_a_plugin_requiring_another_api_version_fails_engine_construction(
    install_plugin, tiny_model, requirement
):
    module = install_plugin("future-plugin", scheduler_plugin(requirement=requirement), "9.0")
    with pytest.raises(PluginError) as info:
        LLM(model=tiny_model)
    message = str(info.value)
    assert f"plugin {module!r} from package future-plugin 9.0" in message
    assert f"requires vlite plugin API {requirement!r}" in message
    served = ", ".join(map(str, range(1, vlite.PLUGIN_API_VERSION + 1)))
    assert f"plugin API versions {served} (newest {vlite.PLUGIN_API_VERSION})" in message


def test_an_unparsable_api_requirement_is_an_error(install_plugin, tiny_model):
    module = install_plugin("sloppy-plugin", scheduler_plugin(requirement="version one"))
    with pytest.raises(PluginError, match=f"plugin '{module}' .* invalid VLITE_PLUGIN_API"):
        LLM(model=tiny_model)


def test_a_hook_with_a_misspelt_name_is_an_error(install_plugin, tiny_model):
    source = """
    import vlite

    @vlite.hookimpl
    def register_scheduler(register):  # should be register_schedulers
        pass
    """
    module = install_plugin("typo-plugin", source)
    with pytest.raises(PluginError) as info:
        LLM(model=tiny_model)
    assert f"plugin {module!r} from package typo-plugin 1.0" in str(info.value)
    assert "register_scheduler" in str(info.value)


def test_a_hook_that_raises_while_registering_is_an_error(install_plugin, tiny_model):
    source = """
    import vlite

    @vlite.hookimpl
    def register_samplers(register):
        raise KeyError("no such sampler")
    """
    module = install_plugin("raising-plugin", source)
    with pytest.raises(PluginError) as info:
        LLM(model=tiny_model)
    message = str(info.value)
    assert f"plugin {module!r} from package raising-plugin 1.0 failed in register_samplers" in (
        message
    )
    assert "KeyError" in message


@pytest.mark.parametrize(
    ("registered", "problem"),
    [
        ("object()", "is not a class (register the class, not an instance)"),
        ("dict", "does not subclass vlite.core.scheduling_policy.SchedulingPolicy"),
        ("type('Half', (Scheduler,), {})", "without defining waiting_sort_key, choose_victim"),
    ],
)
def test_registering_something_that_is_not_a_scheduler_class_is_an_error(
    install_plugin, registered, problem
):
    source = (
        scheduler_plugin()
        .replace("register('newest-first', NewestFirstPolicy)", f"register('odd', {registered})")
        .replace("import vlite\n", "import vlite\nfrom vlite.core.scheduler import Scheduler\n")
    )
    module = install_plugin("odd-plugin", source, "0.2")
    with pytest.raises(PluginError) as info:
        PluginRegistry(build_plugin_manager())
    message = str(info.value)
    assert f"plugin {module!r} (odd-plugin 0.2) registered scheduler 'odd'" in message
    assert problem in message


def test_two_packages_with_the_same_entry_point_name_are_an_error(install_plugin):
    install_plugin("one-package", scheduler_plugin(name="a"), entry_name="shared")
    install_plugin("other-package", scheduler_plugin(name="b"), entry_name="shared")
    with pytest.raises(PluginError, match="plugin name 'shared' is used twice") as info:
        build_plugin_manager()
    assert "one-package 1.0" in str(info.value) and "other-package 1.0" in str(info.value)


# ---- what loads -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "requirement", [None, 1, ">=1", ">=1,<2", "==1", "!=2", 2, ">=2,<3", "==2", "!=1"]
)
def test_a_compatible_plugin_loads_and_its_scheduler_runs(install_plugin, tiny_model, requirement):
    install_plugin("good-plugin", scheduler_plugin(requirement=requirement))
    llm = LLM(model=tiny_model, scheduler="newest-first")
    outputs = llm.generate(["Hello"], SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)
    assert len(outputs[0].outputs[0].token_ids) == 3
    entry = llm.llm_engine.engine_core.registry.entry("scheduler", "newest-first")
    assert (entry.package, entry.version) == ("good-plugin", "1.0")


def test_the_allow_list_restricts_which_plugins_load(install_plugin, monkeypatch, tiny_model):
    wanted = install_plugin("wanted-plugin", scheduler_plugin(name="wanted"))
    install_plugin("exploding-plugin", "raise RuntimeError('must not be imported')")
    install_plugin("unwanted-plugin", scheduler_plugin(name="unwanted"))
    monkeypatch.setenv("VLITE_PLUGINS", f" {wanted} , ")
    registry = PluginRegistry(build_plugin_manager())
    assert "wanted" in registry.names("scheduler")
    assert "unwanted" not in registry.names("scheduler")
    monkeypatch.setenv("VLITE_PLUGINS", "")
    builtin_only = PluginRegistry(build_plugin_manager(load_entry_points=False))
    assert PluginRegistry(build_plugin_manager()).names("scheduler") == builtin_only.names(
        "scheduler"
    )
    LLM(model=tiny_model)  # the exploding plugin is never imported


def test_an_allow_list_name_no_plugin_has_is_a_warning_naming_the_installed(
    install_plugin, monkeypatch
):
    installed = install_plugin("real-plugin", scheduler_plugin(name="real"))
    monkeypatch.setenv("VLITE_PLUGINS", f"{installed},not-installed")
    with pytest.warns(UserWarning, match="'not-installed', which no installed plugin has") as info:
        build_plugin_manager()
    assert installed in str(info[0].message)


# ---- a broken plugin does not take the describing commands down -------------------------


def test_a_broken_plugin_is_skipped_and_reported_where_it_failed(install_plugin):
    source = "import os\nimport a_module_that_is_not_installed\n"
    module = install_plugin("half-installed-plugin", source, "0.9")
    good = install_plugin("good-plugin", scheduler_plugin(name="still-here"))
    broken = []
    registry = PluginRegistry(build_plugin_manager(broken=broken))
    assert "still-here" in registry.names("scheduler")  # the others load
    [plugin] = broken
    assert plugin.name == module and "package half-installed-plugin 0.9" in plugin.error
    assert "a_module_that_is_not_installed" in plugin.error
    assert plugin.location.endswith(f"{module}.py:2")  # the plugin's failing line
    assert "VLITE_PLUGINS" in plugin.describe()
    assert good != module


def test_vlite_help_and_plugins_list_survive_a_broken_plugin(install_plugin):
    module = install_plugin("exploding-plugin", "raise RuntimeError('boom at import')", "2.3")
    for args in (["--help"], ["plugins", "list"]):
        result = subprocess.run(
            [sys.executable, "-m", "vlite", *args], capture_output=True, text=True, timeout=120
        )
        assert result.returncode == 0, result.stderr
        assert "Traceback" not in result.stderr
        assert f"Warning: plugin {module!r} from package exploding-plugin 2.3" in result.stderr
    assert f"BROKEN  {module}: " in result.stdout and "fcfs" in result.stdout


def test_built_in_plugins_load_whatever_the_allow_list(monkeypatch):
    monkeypatch.setenv("VLITE_PLUGINS", "")
    registry = PluginRegistry(build_plugin_manager())
    assert registry.get("scheduler", "fcfs").__name__ == "FcfsPolicy"


# ---- the requirement syntax -------------------------------------------------------------


@pytest.mark.parametrize(
    ("requirement", "clauses"),
    [
        (1, {(">=", "1")}),
        ("1", {(">=", "1")}),
        (">=1", {(">=", "1")}),
        (" >= 1 , < 3 ", {(">=", "1"), ("<", "3")}),
        ("==2,!=3", {("==", "2"), ("!=", "3")}),
        ("<=4,>0", {("<=", "4"), (">", "0")}),
    ],
)
def test_parse_api_requirement(requirement, clauses):
    parsed = parse_api_requirement(requirement)
    assert {(spec.operator, spec.version) for spec in parsed} == clauses


@pytest.mark.parametrize("requirement", ["", "one", "~=1", ">=1;<2", ">>1", True, 1.0, None])
def test_parse_api_requirement_rejects_malformed(requirement):
    with pytest.raises(ValueError):
        parse_api_requirement(requirement)


@pytest.mark.parametrize(
    ("requirement", "version", "allowed"),
    [(">=1", 1, True), (">=2", 1, False), (">=1,<2", 2, False), ("!=1", 2, True), (3, 3, True)],
)
def test_api_requirement_allows(requirement, version, allowed):
    assert api_requirement_allows(requirement, version) is allowed


@pytest.mark.parametrize(
    ("requirement", "allowed"),
    [
        (">=1,<2", True),
        (">=2,<3", True),
        (">=3", True),
        (">=3,<4", True),
        (">=4", True),
        (">=5", True),
        (">=6", True),
        (">=7", True),
        (">=8", True),
        (f">={vlite.PLUGIN_API_VERSION}", True),
        (1, True),
        ("==1", True),
        (f">={NEXT_API}", False),
        ("<1", False),
    ],
)
def test_this_vlite_serves_every_plugin_api_from_1_to_its_own(requirement, allowed):
    assert api_requirement_allows(requirement) is allowed


def test_plugin_api_version_is_public():
    assert isinstance(vlite.PLUGIN_API_VERSION, int) and vlite.PLUGIN_API_VERSION >= 1
