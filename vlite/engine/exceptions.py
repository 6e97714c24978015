"""Errors an online engine (AsyncLLM) raises to the callers of ``generate()``."""

from __future__ import annotations

from vlite.core.errors import VliteError


class EngineStartupError(VliteError, RuntimeError):
    """The engine-core process failed to start; the message holds its error."""


class EngineDeadError(VliteError, RuntimeError):
    """The engine-core process is gone: no request in flight or to come can proceed.

    Build a new engine to continue.
    """


class EngineGenerateError(VliteError, RuntimeError):
    """The engine core failed while running this request (e.g. a step raised).

    The engine itself may still serve other requests.
    """
