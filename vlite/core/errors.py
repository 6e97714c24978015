"""The errors vlite raises on purpose, by what they mean for the caller.

- :class:`VliteError`: the base; anything else escaping vlite is a bug (or a failure
  beneath it), never a verdict on the caller's input.
- :class:`InvalidRequestError`: a request that can never run as given (an empty prompt, one
  longer than the model's context, a sampling value out of range, a request id in use).
  The message names the bad value and what is allowed; the server answers it with 400.
  It is also a ``ValueError``, so code that caught ``ValueError`` keeps working.
- :class:`PluginError`: a plugin failed to load, registered something invalid, or answered
  the engine with something its interface does not allow; the message names the plugin.
- :class:`ExecutorFailedError`: the executor can never run another step (a worker process
  died or is unusable); the engine core stops instead of failing every later step.
- :class:`ConfigError`: a setting the engine cannot run with on this model or machine (an
  unknown plugin name, a backend that cannot run the model, a context longer than the
  model's, a tensor-parallel size its heads do not split over, a model file vlite cannot
  read or run); the message names the setting or file, its value and what is allowed. It
  is also a ``ValueError``.

The CLI turns a :class:`VliteError` into one line on stderr and reports anything else with
its traceback: a plain ``ValueError`` from inside vlite is a bug, not a verdict on the
caller's input.
"""

from __future__ import annotations


class VliteError(Exception):
    """Base class of vlite's own errors."""


class InvalidRequestError(VliteError, ValueError):
    """A request that can never run as given; the message says why and what is allowed."""


class PluginError(VliteError, RuntimeError):
    """A plugin failed to load, registered something invalid, or broke its interface."""


class ExecutorFailedError(VliteError, RuntimeError):
    """The executor can run no more steps (its workers are gone); raised by executors."""


class ConfigError(VliteError, ValueError):
    """A setting the engine cannot run with here; the message names it and what is allowed."""
