"""``vlite run``'s sampling flags, generated from
:class:`~vlite.core.sampling_params.SamplingParams`.

Every field of a type a command line can carry becomes a flag named after it
(``top_p`` -> ``--top-p``): numbers take a value, booleans are switches, lists repeat the
flag. Its help is the field's entry in the class docstring, its default the field's (or the
command's own, :data:`RUN_DEFAULTS`). Fields a flag cannot carry (dicts, token-id
sequences, structured outputs) are set per request in an ``--input`` JSONL file; fields
that clash with an engine setting of the same name (``seed``) or that the command treats
itself (``max_tokens``) are left out.
"""

from __future__ import annotations

import dataclasses
import re
import typing
from collections.abc import Callable
from typing import Any

import click

from vlite.core.sampling_params import SamplingParams

#: Fields ``vlite run`` defines itself (``max_tokens``'s default depends on ``--chat``) or
#: whose flag names an engine setting (``--seed`` seeds the engine).
SKIPPED_FIELDS = frozenset({"max_tokens", "seed"})

#: Where ``vlite run``'s default differs from the class's: it decodes greedily.
RUN_DEFAULTS: dict[str, Any] = {"temperature": 0.0}

#: Flag types by the field's annotation (``X | None`` is taken as ``X``).
_SCALARS: dict[Any, type] = {int: int, float: float, str: str}


def field_docs(cls: type = SamplingParams) -> dict[str, str]:
    """Each attribute's text in ``cls``'s docstring ``Attributes:`` section, on one line."""
    section = (cls.__doc__ or "").split("Attributes:", 1)[-1]
    docs: dict[str, str] = {}
    name = None
    for line in section.splitlines():
        entry = re.match(r"^ {8}(\w+): (.*)$", line)
        if entry:
            name, text = entry.groups()
            docs[name] = text.strip()
        elif name and line.startswith(" " * 12):
            docs[name] += " " + line.strip()
    return docs


def _flag_type(annotation: Any) -> tuple[type, bool] | None:
    """``(click type, repeated)`` for a field's annotation; ``None`` where a flag cannot
    carry it."""
    args = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
    if annotation in _SCALARS or annotation is bool:
        return _SCALARS.get(annotation, bool), False
    if len(args) == 1 and args[0] in _SCALARS:  # X | None
        return _SCALARS[args[0]], False
    lists = [arg for arg in args if typing.get_origin(arg) is list]
    if typing.get_origin(annotation) is list:
        lists = [annotation]
    if len(lists) == 1 and typing.get_args(lists[0])[0] in (str, int):
        return typing.get_args(lists[0])[0], True
    return None


def _help(text: str) -> str:
    """The first sentence of a field's doc, with reST markup dropped."""
    text = text.replace("``", "")
    text = re.sub(r":\w+:`~?([\w.]+)`", lambda m: m.group(1).rsplit(".", 1)[-1], text)
    first = re.split(r"(?<=[.)])\s+(?=[A-Z])", text, maxsplit=1)[0]
    return first.rstrip(".")


def sampling_flag_options() -> list[Callable]:
    """The ``click.option`` decorators of every flag (in field order)."""
    hints = typing.get_type_hints(SamplingParams)
    docs = field_docs()
    options = []
    for field in dataclasses.fields(SamplingParams):
        if field.name in SKIPPED_FIELDS:
            continue
        kind = _flag_type(hints[field.name])
        if kind is None:
            continue
        flag_type, repeated = kind
        flag = "--" + field.name.replace("_", "-")
        help_text = _help(docs.get(field.name, ""))
        if flag_type is bool:
            options.append(click.option(flag, field.name, is_flag=True, help=help_text))
        elif repeated:
            help_text += " (repeatable)"
            options.append(
                click.option(flag, field.name, type=flag_type, multiple=True, help=help_text)
            )
        else:
            default = RUN_DEFAULTS.get(field.name, field.default)
            options.append(
                click.option(
                    flag,
                    field.name,
                    type=flag_type,
                    default=default,
                    show_default=default is not None,
                    help=help_text,
                )
            )
    return options


def sampling_flags(command: Callable) -> Callable:
    """Decorate ``command`` with every sampling flag."""
    for option in reversed(sampling_flag_options()):
        command = option(command)
    return command


def given_sampling(options: dict[str, Any]) -> dict[str, Any]:
    """Pop the sampling flags' values out of a command's ``options``; a repeated flag never
    given (an empty tuple) is left unset, the others become lists."""
    names = {field.name for field in dataclasses.fields(SamplingParams)} - {"max_tokens"}
    values = {name: options.pop(name) for name in list(options) if name in names}
    return {
        name: list(value) if isinstance(value, tuple) else value
        for name, value in values.items()
        if value != ()
    }
