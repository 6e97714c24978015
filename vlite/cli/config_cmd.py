"""``vlite config``: the effective configuration and where each value came from."""

from __future__ import annotations

import click

from vlite.cli.options import build_config, engine_options, pop_engine_overrides
from vlite.core.config import describe_sources


@click.group("config")
def config_group() -> None:
    """Inspect the configuration."""


@config_group.command("show")
@engine_options
def show_command(config_file, **options) -> None:
    """Print each setting, its value, and its source (default, config file, environment, flag)."""
    overrides = pop_engine_overrides(options)
    config = build_config(config_file, overrides)
    sources = describe_sources(config_file, overrides)
    width = max(len(name) for name in sources)
    for name, value in config.model_dump().items():
        click.echo(f"{name.ljust(width)}  {value!s:<24}  ({sources[name]})")
