"""``vlite plugins``: what plugins are installed and what they registered."""

from __future__ import annotations

import click

from vlite.core.plugins import PluginError, PluginRegistry, build_plugin_manager


@click.group("plugins")
def plugins_group() -> None:
    """Inspect installed plugins."""


@plugins_group.command("list")
def list_command() -> None:
    """Print every registered plugin: kind, name, package and version."""
    try:
        registry = PluginRegistry(build_plugin_manager())
    except PluginError as exc:
        raise click.ClickException(str(exc)) from None
    rows = [
        (entry.kind, entry.name, entry.package, entry.version)
        for entry in sorted(registry.entries(), key=lambda e: (e.kind, e.name))
    ]
    headers = ("KIND", "NAME", "PACKAGE", "VERSION")
    widths = [max(len(str(row[i])) for row in [headers, *rows]) for i in range(len(headers))]
    for row in [headers, *rows]:
        click.echo("  ".join(str(cell).ljust(width) for cell, width in zip(row, widths)).rstrip())
