"""Every hook a vlite plugin can implement.

Plugins are modules or objects whose functions carry the ``@vlite.hookimpl`` marker.
All registration hooks run once, when an engine builds its plugin manager (in the
process that constructs the engine: the engine-core process, and again in each worker
process of a multi-process executor). None is called on the per-step hot path: the
engine looks the chosen classes up once and calls them directly.

Each registration hook receives a ``register(name, obj)`` callback rather than returning
values, so that keyword arguments can be added later without breaking plugins. Registering
a name twice (in the same kind) is an error that names both plugins.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pluggy

PROJECT_NAME = "vlite"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)

Register = Callable[[str, Any], None]


@hookspec
def register_schedulers(register: Register) -> None:
    """Register scheduler policies.

    :param register: ``register(name, cls)``; ``cls`` subclasses
        :class:`vlite.core.scheduler.Scheduler` and is constructed as
        ``cls(scheduler_config, kv_cache_manager)``.

    Called at engine construction, in the engine-core process.

    Example::

        @vlite.hookimpl
        def register_schedulers(register):
            register("sjf", ShortestJobFirstScheduler)
    """


@hookspec
def register_attention_backends(register: Register) -> None:
    """Register attention backends.

    :param register: ``register(name, cls)``; ``cls`` subclasses
        :class:`vlite.core.attention.AttentionBackend`.

    Called at engine construction, in every process that builds a model (workers).
    """


@hookspec
def register_samplers(register: Register) -> None:
    """Register samplers.

    :param register: ``register(name, cls)``; ``cls`` implements
        :class:`vlite.core.sampler.Sampler` and is constructed with no arguments.

    Called at engine construction, in every worker process.
    """


@hookspec
def register_executors(register: Register) -> None:
    """Register executors.

    :param register: ``register(name, cls)``; ``cls`` implements
        :class:`vlite.core.executor.Executor` and is constructed as ``cls(config)``.

    Called at engine construction, in the engine-core process.
    """


@hookspec
def register_models(register: Register) -> None:
    """Register model architectures.

    :param register: ``register(architecture, cls)`` where ``architecture`` is a name as
        it appears in a Hugging Face ``config.json`` ``architectures`` list (for example
        ``"LlamaForCausalLM"``) and ``cls`` implements :class:`vlite.core.model.CausalLM`.

    Called at engine construction, in every process that builds a model.
    """


@hookspec
def register_cli_commands(cli: Any) -> None:
    """Add commands to the ``vlite`` command-line interface.

    :param cli: the root ``click.Group``; call ``cli.add_command(...)`` on it.

    Called once when the ``vlite`` command starts, before arguments are parsed.
    """
