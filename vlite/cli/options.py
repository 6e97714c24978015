"""Click options for every setting, generated from the settings classes' fields.

Engine settings come from :class:`VliteConfig`; ``vlite serve``'s own from
:class:`~vlite.server.settings.ServerSettings`.

Each field ``name`` becomes ``--name-with-dashes`` (a boolean one ``--name/--no-name``) with
the field's type, its ``Literal`` values as a ``click.Choice`` and its description as help;
:data:`FLAG_ALIASES` keeps the short spellings users know. A new config field is a new flag
with nothing to restate here.
"""

from __future__ import annotations

import json
import types
import typing
from collections.abc import Callable
from typing import Any

import click
import pydantic
from pydantic import ValidationError

from vlite.core.config import VliteConfig
from vlite.core.errors import ConfigError

#: Shorter spellings accepted beside a field's generated flag.
FLAG_ALIASES: dict[str, tuple[str, ...]] = {
    "attention_backend": ("--attn",),
    "tensor_parallel_size": ("--tp",),
    "pipeline_parallel_size": ("--pp",),
    "enable_prefix_caching": ("--prefix-caching/--no-prefix-caching",),
    "data_parallel_size": ("-dp",),
}


def _click_type(annotation: Any) -> tuple[Any, bool]:
    """``(click type, repeatable)`` of a field annotation: ``X | None`` as ``X``, a
    ``Literal`` as a ``click.Choice``, ``tuple[X, ...]`` as a repeatable ``X``."""
    if typing.get_origin(annotation) is typing.Annotated:
        annotation = typing.get_args(annotation)[0]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        (annotation,) = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
    if typing.get_origin(annotation) is tuple:
        return _click_type(typing.get_args(annotation)[0])[0], True
    if typing.get_origin(annotation) is typing.Literal:
        return click.Choice([str(value) for value in typing.get_args(annotation)]), False
    if isinstance(annotation, type) and issubclass(annotation, pydantic.BaseModel):
        return JSON_OBJECT, False
    return annotation, False


class JsonObject(click.ParamType):
    """A JSON object given on the command line (``'{"method": "ngram"}'``), as a dict; the
    settings class validates its fields."""

    name = "JSON"

    def convert(self, value: Any, param: Any, ctx: Any) -> Any:
        if isinstance(value, dict):
            return value
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError as exc:
            self.fail(f"{value!r} is not JSON: {exc}", param, ctx)
        if not isinstance(parsed, dict):
            self.fail(f"{value!r} is not a JSON object ({{...}})", param, ctx)
        return parsed


JSON_OBJECT = JsonObject()


def settings_option(settings_cls: type, field: str) -> Callable[[Callable], Callable]:
    """The click option of one settings field (``--field-name``, its type and help)."""
    info = settings_cls.model_fields[field]
    flag = "--" + field.replace("_", "-")
    click_type, repeatable = _click_type(info.annotation)
    help_text = info.description or ""
    if click_type is bool:
        declarations = [f"{flag}/--no-{flag[2:]}"]
        kwargs: dict[str, Any] = {}
    else:
        declarations = [flag]
        kwargs = {"type": click_type, "multiple": repeatable}
    if info.default not in (None, ()):
        shown = str(info.default).lower() if click_type is bool else info.default
        help_text += f"  [default: {shown}]"
    declarations += FLAG_ALIASES.get(field, ())
    # default=None: a flag not given is not an override (the file or environment may set it).
    return click.option(*declarations, field, default=None, help=help_text, **kwargs)


def engine_option(field: str) -> Callable[[Callable], Callable]:
    """The click option of one :class:`VliteConfig` field."""
    return settings_option(VliteConfig, field)


def given_options(options: dict[str, Any], fields: tuple[str, ...]) -> dict[str, Any]:
    """Remove ``fields`` from a command's keyword arguments; return the ones given (not
    ``None``, and a repeatable option not empty)."""
    popped = {field: options.pop(field) for field in fields if field in options}
    return {field: value for field, value in popped.items() if value not in (None, ())}


#: Every :class:`VliteConfig` field, in declaration order: each has a flag.
ENGINE_FIELDS: tuple[str, ...] = tuple(VliteConfig.model_fields)


CONFIG_FILE_OPTION = click.option(
    "--config",
    "config_file",
    type=click.Path(dir_okay=False),
    envvar="VLITE_CONFIG",
    help="TOML file of settings (file < VLITE_* environment < flags).",
)


def engine_options(command: Callable) -> Callable:
    """Add every engine flag and ``--config`` to a click command."""
    for field in reversed(ENGINE_FIELDS):
        command = engine_option(field)(command)
    return CONFIG_FILE_OPTION(command)


def pop_engine_overrides(options: dict[str, Any]) -> dict[str, Any]:
    """Remove the engine flags from a command's keyword arguments; return the given ones."""
    return given_options(options, ENGINE_FIELDS)


def build_settings(settings_cls: type, overrides: dict[str, Any]) -> Any:
    """``settings_cls(**overrides)`` (the environment fills the rest); invalid settings
    become a one-line click error."""
    try:
        return settings_cls(**overrides)
    except ValidationError as exc:
        raise click.UsageError(describe_validation_error(exc)) from None


def build_config(config_file: str | None, overrides: dict[str, Any]) -> VliteConfig:
    """The effective config; invalid settings become a one-line click error."""
    try:
        return VliteConfig.load(config_file, **overrides)
    except ValidationError as exc:
        raise click.UsageError(describe_validation_error(exc)) from None
    except (ConfigError, FileNotFoundError) as exc:
        raise click.UsageError(str(exc)) from None


def describe_validation_error(exc: ValidationError) -> str:
    """One line per invalid field: ``field=value: why``."""
    problems = []
    for error in exc.errors():
        field = ".".join(str(part) for part in error["loc"]) or "config"
        message = error["msg"].removeprefix("Value error, ")
        problems.append(f"invalid {field}={error.get('input')!r}: {message}")
    return "; ".join(problems)
