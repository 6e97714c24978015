"""Errors an online engine (AsyncLLM) raises to the callers of ``generate()``."""

from __future__ import annotations


class EngineStartupError(RuntimeError):
    """The engine-core process failed to start; the message holds its error."""


class EngineDeadError(RuntimeError):
    """The engine-core process is gone: no request in flight or to come can proceed.

    Build a new engine to continue.
    """


class EngineGenerateError(RuntimeError):
    """The engine core failed while running this request (e.g. a step raised).

    The engine itself may still serve other requests.
    """
