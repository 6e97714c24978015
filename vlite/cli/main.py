"""The ``vlite`` command: ``run``, ``plugins``, ``config``, and commands plugins add."""

from __future__ import annotations

import click

from vlite import __version__
from vlite.cli.bench import bench_command
from vlite.cli.config_cmd import config_group
from vlite.cli.plugins_cmd import plugins_group
from vlite.cli.run import run_command
from vlite.cli.serve import serve_command


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="vlite")
def cli() -> None:
    """vlite: a small, fast, plugin-architected LLM inference engine.

    Run `vlite run "Hello"` to generate with the default model (SmolLM2-135M-Instruct),
    `vlite serve` for an OpenAI-compatible server, and `vlite COMMAND --help` for each
    command's options.
    """


cli.add_command(run_command)
cli.add_command(serve_command)
cli.add_command(plugins_group)
cli.add_command(config_group)
cli.add_command(bench_command)


def main() -> None:
    """Console-script entry point: adds plugin commands, then runs the CLI.

    A plugin that fails to load is skipped with a warning (``vlite --help`` and ``vlite
    plugins list`` keep working); commands that build an engine refuse to run without it.
    """
    from vlite.core.plugins import BrokenPlugin, PluginError, build_plugin_manager

    broken: list[BrokenPlugin] = []
    try:
        pm = build_plugin_manager(broken=broken)
    except PluginError as exc:
        raise SystemExit(f"Error: {exc}") from None
    for plugin in broken:
        click.echo(f"Warning: {plugin.describe()}", err=True)
    pm.hook.register_cli_commands(cli=cli)
    cli(prog_name="vlite")
