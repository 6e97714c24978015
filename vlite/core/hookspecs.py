"""Every hook a vlite plugin can implement.

Plugins are modules or objects whose functions carry the ``@vlite.hookimpl`` marker.
All registration hooks run once, when an engine builds its plugin manager (in the
process that constructs the engine: the engine-core process, and again in each worker
process of a multi-process executor). None is called on the per-step hot path: the
engine looks the chosen classes up once and calls them directly.

Each registration hook receives a ``register(name, obj)`` callback rather than returning
values, so that keyword arguments can be added later without breaking plugins. Registering
a name twice (in the same kind) is an error that names both plugins.

:data:`PLUGIN_API_VERSION` versions this module and the plugin interfaces in ``vlite.core``;
a plugin may require a range of it with a module-level ``VLITE_PLUGIN_API`` (see
:func:`vlite.core.plugins.check_plugin_api`). ``docs/plugins.md`` documents every hook.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pluggy

PROJECT_NAME = "vlite"

#: Version of the plugin API: the hooks below and the plugin interfaces in ``vlite.core``
#: (``SchedulingPolicy``, ``AttentionBackend``, ``Sampler``, ``Executor``, ``CausalLM``,
#: ``StructuredOutputBackend``, ``LogitsProcessor``, ``WeightFormat``, ``Proposer``,
#: ``ToolParser``, ``ReasoningParser``) with their metadata
#: types. It is raised by one whenever they change in a way a plugin could notice: a hook or
#: an interface member added, changed or removed. A plugin declares the versions it works with
#: as ``VLITE_PLUGIN_API = ">=2,<3"`` (or ``2``, meaning ``>=2``).
PLUGIN_API_VERSION = 10
#: Every plugin API version this vlite still serves, oldest first. A plugin loads if its
#: ``VLITE_PLUGIN_API`` admits any of them. Version 1 differs only in how schedulers are
#: written (subclasses of ``vlite.core.scheduler.Scheduler``, deprecated; version 2 registers
#: ``SchedulingPolicy`` subclasses and moved chunked prefill into the mechanism). Version 3
#: added the structured-output backend and logits-processor kinds, version 4 the weight-format
#: kind (and the model classes' GGUF tensor-name hook), version 5 ``WeightFormat.configure``
#: (optional, a no-op by default), version 6 the proposer kind, version 7 draft models'
#: fields (all with defaults), the tool-call parser kind and the reasoning parser kind,
#: version 8 the parsers' markers and constraints after the reasoning (with defaults),
#: version 9 the scheduler's inter-token target, version 10 the attention backends' KV-cache
#: dtypes (default: the model's only); nothing older changed.
SUPPORTED_PLUGIN_APIS = (1, 2, 3, 4, 5, 6, 7, 8, 9, 10)

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)

Register = Callable[[str, Any], None]


@hookspec
def register_schedulers(register: Register) -> None:
    """Register scheduler policies.

    :param register: ``register(name, cls)``; ``cls`` subclasses
        :class:`vlite.core.scheduling_policy.SchedulingPolicy` and is constructed as
        ``cls()``; the core's scheduler (the mechanism: budget, blocks, chunked prefill,
        preemption) asks it in which order to admit and whom to preempt. (Plugin API 1:
        a subclass of :class:`vlite.core.scheduler.Scheduler`, constructed as
        ``cls(limits, kv_cache_manager)``; still accepted, deprecated.)

    Called at engine construction, in the engine-core process.

    Example::

        @vlite.hookimpl
        def register_schedulers(register):
            register("sjf", ShortestJobFirstPolicy)
    """


@hookspec
def register_attention_backends(register: Register) -> None:
    """Register attention backends.

    :param register: ``register(name, cls)``; ``cls`` subclasses
        :class:`vlite.core.attention.AttentionBackend`; the model constructs it once as
        ``cls(num_heads, num_kv_heads, head_dim, scale, block_size)``.

    Called at engine construction, in the engine-core process (to validate the name) and
    in every process that builds a model (workers).
    """


@hookspec
def register_samplers(register: Register) -> None:
    """Register samplers.

    :param register: ``register(name, cls)``; ``cls`` implements
        :class:`vlite.core.sampler.Sampler` and is constructed with no arguments.

    Called at engine construction, in the engine-core process (to validate the name) and
    in every worker process, which constructs the sampler.
    """


@hookspec
def register_executors(register: Register) -> None:
    """Register executors.

    :param register: ``register(name, cls)``; ``cls`` implements
        :class:`vlite.core.executor.Executor` and is constructed as
        ``cls(config, registry)`` (the :class:`~vlite.core.config.VliteConfig` and the
        engine's :class:`~vlite.core.plugins.PluginRegistry`).

    Called at engine construction, in the engine-core process.
    """


@hookspec
def register_models(register: Register) -> None:
    """Register model architectures.

    :param register: ``register(architecture, cls)`` where ``architecture`` is a name as
        it appears in a Hugging Face ``config.json`` ``architectures`` list (for example
        ``"LlamaForCausalLM"``) and ``cls`` implements :class:`vlite.core.model.CausalLM`.

    Called at engine construction, in every process that builds a model; ``docs/models.md``
    shows how a model plugin is written.
    """


@hookspec
def register_structured_output_backends(register: Register) -> None:
    """Register structured-output backends (JSON schemas, regexes, choices, grammars).

    :param register: ``register(name, cls)``; ``cls`` implements
        :class:`vlite.core.structured_output.StructuredOutputBackend`: the class method
        ``validate(params)`` (no tokenizer; the front end calls it to refuse a bad
        constraint with a 400), and, constructed as ``cls(tokenizer, vocab_size)`` on first
        use, ``compile(params)`` returning a grammar whose ``new_matcher()`` tracks one
        request's output (``fill_bitmask``, ``accept_token``, ``rollback``,
        ``is_terminated``).

    Called at engine construction, in the engine-core process (which compiles and matches;
    workers only apply the bitmask it sends), and in the front end (to validate).
    ``vlite.testing.StructuredOutputBackendConformance`` checks an implementation.

    Example::

        @vlite.hookimpl
        def register_structured_output_backends(register):
            register("my-grammars", MyGrammarBackend)
    """


@hookspec
def register_logits_processors(register: Register) -> None:
    """Register batch-level logits processors.

    :param register: ``register(name, cls)``; ``cls`` subclasses
        :class:`vlite.core.logits_processor.LogitsProcessor` and is constructed once per
        worker as ``cls(config, device, vocab_size)``. Every registered processor runs in
        every worker: each step it learns the batch's changes (``update_state``) and edits
        the logits of the rows it applies to (``apply``), before the sampler plugin; it
        decides from a request's ``SamplingParams`` (a third-party one from its key in
        ``extra_args``) whether it applies. ``vlite.testing.LogitsProcessorConformance``
        checks an implementation.

    Called in every process that builds a model runner (workers).
    """


@hookspec
def register_weight_formats(register: Register) -> None:
    """Register weight formats: encodings (GGUF's block-quantized types, ...) in which
    matrices stay in memory and are multiplied without a float copy.

    :param register: ``register(name, cls)``; ``cls`` subclasses
        :class:`vlite.core.weight_format.WeightFormat` and is constructed as ``cls()``. It
        names the stored tensor types it takes (``tensor_types``) and loads, cuts (tensor
        parallelism), joins (fused layers, stacked experts), multiplies (``linear``,
        ``expert_linear``), gathers embedding rows from and dequantizes the
        :class:`~vlite.core.weight_format.QuantizedWeight` objects it makes. The quantization
        plan keeps each tensor in the first registered format that takes its type and runs
        on the device (installed plugins before vlite's built-in ``gguf``).
        ``vlite.testing.WeightFormatConformance`` checks an implementation.

    Called at engine construction, in the engine-core process (for the quantization plan
    it reports) and in every process that builds a model (workers), which load the weights
    through the chosen formats.

    Example::

        @vlite.hookimpl
        def register_weight_formats(register):
            register("my-q4", MyQ4Format)
    """


@hookspec
def register_proposers(register: Register) -> None:
    """Register speculative-decoding proposers.

    :param register: ``register(name, cls)``; ``cls`` subclasses
        :class:`vlite.core.proposer.Proposer` and is constructed as ``cls(config)`` with the
        engine's :class:`~vlite.core.proposer.SpeculativeConfig` when its ``method`` names
        it. After every step it proposes draft tokens for running requests, which the next
        step verifies against the target model (the output is the target's either way).
        ``vlite.testing.ProposerConformance`` checks an implementation.

    Called at engine construction, in the engine-core process.

    Example::

        @vlite.hookimpl
        def register_proposers(register):
            register("my-lookup", MyLookupProposer)
    """


@hookspec
def register_tool_parsers(register: Register) -> None:
    """Register tool-call parsers: readers of the calls a chat model writes in its own
    format, for ``tool_choice="auto"``.

    :param register: ``register(name, cls)``; ``cls`` subclasses
        :class:`vlite.core.tool_parser.ToolParser` and is constructed once per reply as
        ``cls(tools)`` (the request's tools) when ``vlite serve --tool-call-parser`` names
        it (or, with no parser named, when the model's chat template has its
        ``template_markers``). The server feeds it the reply's text as it is generated
        (``feed``, then ``finish``) and sends the content and calls it reads.
        ``vlite.testing.ToolParserConformance`` checks an implementation.

    Called when the server starts, in the server's process (the front end, not the engine
    core).

    Example::

        @vlite.hookimpl
        def register_tool_parsers(register):
            register("my-format", MyToolParser)
    """


@hookspec
def register_reasoning_parsers(register: Register) -> None:
    """Register reasoning parsers: splitters of a thinking model's reply into its reasoning
    (``<think>...</think>``, ...) and its answer.

    :param register: ``register(name, cls)``; ``cls`` subclasses
        :class:`vlite.core.reasoning_parser.ReasoningParser` and is constructed once per
        reply as ``cls()`` when ``vlite serve --reasoning-parser`` names it. The server
        feeds it the reply's text as it is generated (``feed``, then ``finish``) and sends
        the reasoning as ``reasoning_content`` and the answer as ``content`` (the only text
        a tool-call parser reads). ``vlite.testing.ReasoningParserConformance`` checks an
        implementation.

    Called when the server starts, in the server's process (the front end, not the engine
    core).

    Example::

        @vlite.hookimpl
        def register_reasoning_parsers(register):
            register("my-tags", MyReasoningParser)
    """


@hookspec
def register_cli_commands(cli: Any) -> None:
    """Add commands to the ``vlite`` command-line interface.

    :param cli: the root ``click.Group``; call ``cli.add_command(...)`` on it.

    Called once by :func:`vlite.cli.main.main` when the ``vlite`` command starts, before
    arguments are parsed, in the command's process. Not called by engines.
    """
