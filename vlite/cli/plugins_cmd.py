"""``vlite plugins``: what plugins are installed, what they registered, and whether they conform."""

from __future__ import annotations

from collections.abc import Sequence

import click

from vlite.core.plugins import BrokenPlugin, PluginError, PluginRegistry, build_plugin_manager


@click.group("plugins")
def plugins_group() -> None:
    """Inspect installed plugins."""


def _load_registry(broken: list[BrokenPlugin] | None = None) -> PluginRegistry:
    """The registry; with ``broken`` given, plugins that fail to load are left out and
    listed there instead."""
    try:
        return PluginRegistry(build_plugin_manager(broken=broken))
    except PluginError as exc:
        raise click.ClickException(str(exc)) from None


def _echo_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    widths = [max(len(str(row[i])) for row in [headers, *rows]) for i in range(len(headers))]
    for row in [headers, *rows]:
        click.echo("  ".join(str(cell).ljust(width) for cell, width in zip(row, widths)).rstrip())


@plugins_group.command("list")
def list_command() -> None:
    """Print every registered plugin: kind, name, package and version; then any installed
    plugin that failed to load, with its error."""
    broken: list[BrokenPlugin] = []
    registry = _load_registry(broken)
    rows = [
        (entry.kind, entry.name, entry.package, entry.version)
        for entry in sorted(registry.entries(), key=lambda e: (e.kind, e.name))
    ]
    _echo_table(("KIND", "NAME", "PACKAGE", "VERSION"), rows)
    for plugin in broken:
        click.echo(f"BROKEN  {plugin.name}: {plugin.describe()}")


@plugins_group.command("check")
@click.argument("name")
@click.option("--kind", help="The plugin kind, when NAME is registered as several kinds.")
@click.option("-k", "keyword", help="Only run tests matching this pytest -k expression.")
@click.option("--timeout", type=float, default=None, help="Give up after this many seconds.")
@click.option("-v", "--verbose", is_flag=True, help="Also print pytest's output.")
def check_command(
    name: str, kind: str | None, keyword: str | None, timeout: float | None, verbose: bool
) -> None:
    """Run the conformance suite of NAME's kind against it and print a pass/fail table.

    NAME is a registry name as `vlite plugins list` shows it. The suite runs in a pytest
    subprocess (pytest must be installed); the exit status is 0 only if no test failed.
    """
    from vlite.testing.check import run_conformance
    from vlite.testing.conformance import CONFORMANCE_SUITES

    registry = _load_registry()
    kinds = registry.kinds_of(name)
    if not kinds:
        available = sorted({e.name for e in registry.entries() if e.kind in CONFORMANCE_SUITES})
        raise click.ClickException(
            f"no plugin is registered as {name!r}; available: {', '.join(available)}"
        )
    if kind is None:
        if len(kinds) > 1:
            raise click.ClickException(
                f"{name!r} is registered as several kinds ({', '.join(kinds)}); pass --kind"
            )
        kind = kinds[0]
    if kind not in kinds:
        raise click.ClickException(f"{name!r} is registered as {', '.join(kinds)}, not {kind}")
    if kind not in CONFORMANCE_SUITES:
        raise click.ClickException(
            f"there is no conformance suite for {kind} plugins; suites exist for: "
            f"{', '.join(CONFORMANCE_SUITES)}"
        )
    entry = registry.entry(kind, name)
    origin = " ".join(part for part in (entry.package, entry.version) if part)
    click.echo(f"Checking {kind} {name!r} ({origin}) with the {kind} conformance suite...")
    report = run_conformance(kind, name, keyword=keyword, timeout_s=timeout)
    if verbose or not report.outcomes:
        click.echo(report.output)
    rows = [
        (result.name, result.outcome.upper(), f"{result.duration_s:.2f}s", _first_line(result))
        for result in report.outcomes
    ]
    _echo_table(("TEST", "RESULT", "TIME", "DETAIL"), rows)
    summary = ", ".join(
        f"{report.count(outcome)} {outcome}"
        for outcome in ("passed", "failed", "error", "skipped")
        if report.count(outcome)
    )
    verdict = "PASS" if report.passed else "FAIL"
    click.echo(
        f"{verdict}: {report.suite} on {kind} {name!r}: {summary or 'no tests ran'} "
        f"in {report.duration_s:.1f}s"
    )
    if not report.passed:
        raise SystemExit(1)


def _first_line(result) -> str:
    if result.outcome == "passed" or not result.message:
        return ""
    line = result.message.strip().splitlines()[0]
    return line if len(line) <= 90 else line[:87] + "..."
