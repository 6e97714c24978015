"""Running a conformance suite in process, to check what it catches (seeded-bug tests),
and reading ``vlite plugins check``'s table.

A seeded-bug test writes a plugin author's test module (a subclass of a suite naming a
deliberately broken plugin) with pytest's ``pytester`` fixture and runs it in this process;
:func:`run_suite_outcomes` returns each test's outcome. Import the modules the inner run
needs (the broken plugins, torch, grammar libraries) before the first run: an in-process
run drops the modules it imported, and importing an extension module a second time can
crash the process.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def run_suite_outcomes(pytester: Any, plugin_dir: Path, module_text: str) -> dict[str, str]:
    """Test name (with parameters) -> ``"passed"``, ``"failed"`` or ``"skipped"``.

    Args:
        pytester: pytest's ``pytester`` fixture.
        plugin_dir: a folder put on ``sys.path`` for the run (where the broken plugins are).
        module_text: the test module to write and run.
    """
    pytester.syspathinsert(plugin_dir)
    pytester.makepyfile(test_suite_run=module_text)
    recorder = pytester.inline_run("-p", "no:cacheprovider")
    outcomes: dict[str, str] = {}
    for report in recorder.getreports("pytest_runtest_logreport"):
        test_name = report.nodeid.split("::")[-1]
        if report.failed:
            outcomes[test_name] = "failed"
        elif report.skipped:
            outcomes[test_name] = "skipped"
        else:
            outcomes.setdefault(test_name, "passed")
    assert outcomes, "no test ran"
    return outcomes


#: The first test of every suite: the plugin loads through a fresh plugin manager.
LOADS = "test_plugin_loads_through_a_fresh_plugin_manager"


def assert_caught(
    outcomes: dict[str, str], expected: set[str], unaffected: set[str] = frozenset()
) -> None:
    """A suite run on a broken plugin (``outcomes`` of :func:`run_suite_outcomes`) loaded
    it, failed every test in ``expected`` and passed every test in ``unaffected``."""
    failed = {name for name, outcome in outcomes.items() if outcome == "failed"}
    assert outcomes[LOADS] == "passed"
    assert expected <= failed, f"missed: {expected - failed}; failed: {failed}"
    passed = {name for name, outcome in outcomes.items() if outcome == "passed"}
    assert unaffected <= passed, f"failed beyond the bug: {unaffected - passed}"


def check_table_rows(stdout: str) -> dict[str, str]:
    """Test name -> RESULT, from the table ``vlite plugins check`` prints under ``TEST``."""
    lines = stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("TEST "))
    rows = {}
    for line in lines[start + 1 :]:
        if line.startswith(("PASS:", "FAIL:")):
            break
        name, result = line.split()[:2]
        rows[name] = result
    return rows
