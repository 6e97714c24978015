"""Twenty JSON schemas of varied shape (nested objects, arrays, enums, bounded numbers,
required fields), each with a prompt that asks for it: the structured-output proof test
and ``benchmarks/structured_outputs.py`` share them. Strings and arrays are bounded, so
a small model's output always closes within a few hundred tokens."""

from __future__ import annotations

from typing import Any


def _string(max_length: int = 24, pattern: str | None = None) -> dict[str, Any]:
    if pattern is not None:
        return {"type": "string", "pattern": pattern}
    return {"type": "string", "maxLength": max_length}


def _int(low: int, high: int) -> dict[str, Any]:
    return {"type": "integer", "minimum": low, "maximum": high}


def _number(low: float, high: float) -> dict[str, Any]:
    return {"type": "number", "minimum": low, "maximum": high}


def _enum(*values: str) -> dict[str, Any]:
    return {"enum": list(values)}


def _array(items: dict[str, Any], low: int, high: int) -> dict[str, Any]:
    return {"type": "array", "items": items, "minItems": low, "maxItems": high}


BOOL = {"type": "boolean"}


def _object(properties: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties) if required is None else required,
        "additionalProperties": False,
    }


SCHEMAS: list[tuple[str, dict[str, Any]]] = [
    ("a person", _object({"name": _string(), "age": _int(0, 120)})),
    ("a city", _object({"city": _string(), "country": _string(), "population": _int(0, 10**8)})),
    ("a book", _object({"title": _string(40), "author": _string(), "year": _int(1400, 2030)})),
    ("a verdict", _object({"answer": _enum("yes", "no"), "confidence": _number(0, 1)})),
    ("a colour", _object({"name": _string(), "rgb": _array(_int(0, 255), 3, 3)})),
    ("a shopping list", _object({"items": _array(_string(16), 1, 4)})),
    ("a product", _object({"name": _string(), "price": _number(0, 10000), "in_stock": BOOL})),
    (
        "a weather report",
        _object(
            {
                "city": _string(),
                "temperature_c": _number(-60, 60),
                "sky": _enum("clear", "cloudy", "rain", "snow"),
            }
        ),
    ),
    (
        "a user account",
        _object(
            {
                "username": _string(16),
                "email": _string(32),
                "roles": _array(_enum("admin", "editor", "viewer"), 0, 3),
            }
        ),
    ),
    (
        "an address",
        _object(
            {"street": _string(32), "number": _int(1, 9999), "zip": _string(pattern="^[0-9]{5}$")}
        ),
    ),
    (
        "a movie",
        _object(
            {
                "title": _string(40),
                "genres": _array(_enum("drama", "comedy", "action", "horror"), 1, 2),
                "rating": _int(1, 10),
            }
        ),
    ),
    (
        "a recipe",
        _object({"dish": _string(), "steps": _array(_string(32), 1, 3), "minutes": _int(1, 600)}),
    ),
    (
        "an employee",
        _object({"name": _string(), "team": _object({"name": _string(), "size": _int(1, 50)})}),
    ),
    (
        "a calendar event",
        _object(
            {
                "title": _string(),
                "day": _enum("mon", "tue", "wed", "thu", "fri"),
                "hour": _int(0, 23),
            }
        ),
    ),
    ("a planet", _object({"name": _string(), "moons": _int(0, 200), "has_rings": BOOL})),
    (
        "a student's grades",
        _object(
            {
                "student": _string(),
                "grades": _array(_object({"subject": _string(16), "score": _int(0, 100)}), 1, 2),
            }
        ),
    ),
    (
        "a car",
        _object(
            {"make": _string(), "model": _string(), "electric": BOOL}, required=["make", "model"]
        ),
    ),
    (
        "a flight",
        _object(
            {
                "from": _string(pattern="^[A-Z]{3}$"),
                "to": _string(pattern="^[A-Z]{3}$"),
                "seats": _int(1, 9),
            }
        ),
    ),
    (
        "a pet",
        _object(
            {"name": _string(), "species": _enum("cat", "dog", "bird", "fish"), "age": _int(0, 30)}
        ),
    ),
    (
        "a task list",
        _object(
            {
                "project": _string(),
                "tasks": _array(_object({"title": _string(24), "done": BOOL}), 1, 2),
            }
        ),
    ),
]


def schema_prompt(subject: str) -> str:
    """The chat message that asks for ``subject`` as JSON."""
    return f"Describe {subject} as a JSON object."
