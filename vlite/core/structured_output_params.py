"""StructuredOutputsParams: the shape a request's output must have (vLLM's fields).

Exactly one of the constraint fields is set:

- ``json``: a JSON schema (a dict, or its JSON text); the output is a JSON value that
  validates against it;
- ``json_object``: ``True``; the output is any JSON object;
- ``regex``: the output matches the regular expression (whole output);
- ``choice``: the output is one of these strings;
- ``grammar``: the output is a sentence of this EBNF grammar (GBNF: ``root ::= ...``).

``backend`` names the structured-output backend plugin for this request (default: the
engine's ``structured_outputs_backend``). ``after_reasoning`` (the
:class:`~vlite.core.reasoning_parser.ReasoningMarkers` of a reasoning parser, e.g.
``Qwen3ReasoningParser.markers``) constrains only the answer after the reply's reasoning
(:mod:`vlite.core.reasoning_grammar`); the server sets it from ``--reasoning-parser``.
Problems are reported at construction, naming the field, as
:class:`~vlite.core.sampling_params.SamplingParamsError` does.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from vlite.core.errors import InvalidRequestError
from vlite.core.reasoning_parser import ReasoningMarkers

#: The constraint fields, of which a request sets exactly one.
CONSTRAINT_FIELDS = ("json", "json_object", "regex", "choice", "grammar")


class StructuredOutputsError(InvalidRequestError):
    """An invalid structured-output request; ``param`` names the field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class StructuredOutputsParams:
    """The constraint on a request's output (see the module docstring)."""

    json: dict[str, Any] | str | None = None
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    backend: str | None = None
    after_reasoning: ReasoningMarkers | None = None

    def __post_init__(self) -> None:
        chosen = [name for name in CONSTRAINT_FIELDS if self._is_set(name)]
        if len(chosen) != 1:
            named = ", ".join(chosen) if chosen else "none"
            raise StructuredOutputsError(
                f"structured_outputs must set exactly one of {', '.join(CONSTRAINT_FIELDS)}; "
                f"it sets {named}",
                "structured_outputs",
            )
        self._check_value(chosen[0])
        if self.backend is not None and not (isinstance(self.backend, str) and self.backend):
            self._fail("backend", "None or a backend name")
        if self.after_reasoning is not None and not isinstance(
            self.after_reasoning, ReasoningMarkers
        ):
            self._fail("after_reasoning", "None or ReasoningMarkers")

    def _is_set(self, name: str) -> bool:
        value = getattr(self, name)
        return value is not None and value is not False

    def _check_value(self, name: str) -> None:
        value = getattr(self, name)
        if name == "json":
            self._check_schema(value)
        elif name == "json_object":
            if value is not True:
                self._fail(name, "True")
        elif name == "choice":
            if not (isinstance(value, list) and value and all(isinstance(c, str) for c in value)):
                self._fail(name, "a non-empty list of strings")
            if any(not c for c in value):
                self._fail(name, "a list of non-empty strings")
        elif not (isinstance(value, str) and value.strip()):
            self._fail(name, "a non-empty string")

    def _check_schema(self, value: Any) -> None:
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise StructuredOutputsError(
                    f"structured_outputs.json is not valid JSON: {exc}", "structured_outputs.json"
                ) from None
        if not isinstance(value, dict):
            self._fail("json", "a JSON schema: an object (dict) or its JSON text")

    def _fail(self, name: str, allowed: str) -> None:
        value = getattr(self, name)
        raise StructuredOutputsError(
            f"structured_outputs.{name}={_short(value)} is invalid: must be {allowed}",
            f"structured_outputs.{name}",
        )

    @property
    def kind(self) -> str:
        """Which constraint is set: one of :data:`CONSTRAINT_FIELDS`."""
        return next(name for name in CONSTRAINT_FIELDS if self._is_set(name))

    @property
    def spec(self) -> str:
        """The constraint as text: the schema's compact JSON (its properties in their order,
        which is the order the output gives them), the regex, the grammar, the choices as a
        JSON list, or ``""`` for ``json_object``."""
        kind = self.kind
        if kind == "json":
            schema = json.loads(self.json) if isinstance(self.json, str) else self.json
            return json.dumps(schema, separators=(",", ":"))
        if kind == "choice":
            return json.dumps(self.choice)
        if kind == "json_object":
            return ""
        return getattr(self, kind)

    @property
    def key(self) -> tuple[str, str]:
        """``(kind, spec)``: equal for equal constraints (what compiled grammars are cached
        by, with the backend and ``after_reasoning``)."""
        return self.kind, self.spec


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
