"""``vlite serve``: the OpenAI-compatible HTTP server."""

from __future__ import annotations

from collections.abc import Callable

import click

from vlite.cli.options import (
    build_config,
    build_settings,
    engine_options,
    given_options,
    pop_engine_overrides,
    settings_option,
)
from vlite.core.errors import VliteError
from vlite.server.settings import ServerSettings

#: Every :class:`ServerSettings` field: each has a flag.
SERVER_FIELDS: tuple[str, ...] = tuple(ServerSettings.model_fields)


def server_options(command: Callable) -> Callable:
    """Add every :class:`~vlite.server.settings.ServerSettings` flag to a click command."""
    for field in reversed(SERVER_FIELDS):
        command = settings_option(ServerSettings, field)(command)
    return command


@click.command("serve")
@server_options
@engine_options
def serve_command(config_file, **options):
    """Serve the model over an OpenAI-compatible HTTP API.

    Endpoints: GET /health, GET /v1/models, POST /v1/completions and
    POST /v1/chat/completions ("stream": true streams server-sent events), GET /metrics
    (Prometheus). The engine core runs in its own process.

    Unless told otherwise (--no-enable-chunked-prefill, VLITE_ENABLE_CHUNKED_PREFILL or a
    config file), the server chunks long prompts, with any --scheduler policy, under
    --max-num-batched-tokens 128 on CPU, 2048 on CUDA (unless set), so a new prompt does
    not stall the streams already running.

    The KV cache stays large by default: the server cannot know its load, so it takes the
    smaller of the memory budget (--kv-cache-memory-gib: 2 GiB on CPU, 90% of free GPU
    memory on CUDA) and what --max-num-seqs sequences of max_model_len tokens need (vlite
    run, which knows its requests, sizes its cache to them). --num-kv-blocks sets the size
    exactly, --kv-cache-tokens caps it; the plan is printed at start ("memory: ...").

    With --api-key (or VLITE_API_KEY), every route but /health and /metrics needs
    'Authorization: Bearer KEY'. SIGTERM or Ctrl-C drains: new requests get 503, running
    ones get --shutdown-timeout-s seconds, then the server stops (exit status 0; a second
    signal stops at once). If the engine core dies, the server stops with exit status 1.

    With --data-parallel-size N (-dp N) the server runs N engine-core processes on the
    same model, each with its own workers, and sends each new request to the least-loaded
    one; /metrics labels each core's series engine="i" beside the unlabeled totals, and if
    any core dies the server stops as above.

    \b
    Examples:
      vlite serve --port 8000
      VLITE_API_KEY=secret vlite serve --host 0.0.0.0
      curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
        -d '{"prompt": "The capital of France is", "max_tokens": 16, "temperature": 0}'
      curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\
        -d '{"messages": [{"role": "user", "content": "Hi"}], "stream": true}'
    """
    server_overrides = given_options(options, SERVER_FIELDS)
    overrides = pop_engine_overrides(options)
    config = build_config(config_file, overrides)
    settings = build_settings(ServerSettings, server_overrides)
    _check_parsers(settings)

    from vlite.engine.exceptions import EngineStartupError
    from vlite.server.api_server import ApiServer, bind_socket, with_serving_defaults

    config = with_serving_defaults(config, config_file, overrides, settings.data_parallel_size)

    try:
        sock = bind_socket(settings.host, settings.port)
    except OSError as exc:
        raise click.ClickException(
            f"cannot listen on {settings.host}:{settings.port}: {exc.strerror}"
        ) from None
    server = ApiServer(config, sock, settings, on_ready=lambda ready: _on_ready(ready, settings))
    try:
        server.run()
    except KeyboardInterrupt:
        pass
    except (EngineStartupError, VliteError, FileNotFoundError, ImportError) as exc:
        raise click.ClickException(str(exc)) from None
    finally:
        sock.close()
    if server.exit_code:
        click.echo("vlite server stopped: the engine core died", err=True)
        raise SystemExit(server.exit_code)
    click.echo("vlite server stopped", err=True)


def _check_parsers(settings: ServerSettings) -> None:
    """Refuse an unknown ``--tool-call-parser`` or ``--reasoning-parser`` before the engine
    starts, naming the registered ones."""
    from vlite.server.reasoning import reasoning_parser_class
    from vlite.server.tool_calls import NO_PARSER, tool_parser_class

    tool_call_parser = settings.tool_call_parser
    for name, lookup in (
        (None if tool_call_parser == NO_PARSER else tool_call_parser, tool_parser_class),
        (settings.reasoning_parser, reasoning_parser_class),
    ):
        if name is None:
            continue
        try:
            lookup(name)
        except VliteError as exc:
            raise click.ClickException(str(exc)) from None


def _on_ready(server, given: ServerSettings) -> None:
    """The server is up: its start-up objects leave the collector's way, and it says what
    it runs."""
    from vlite.engine.startup_heap import freeze_startup_heap

    freeze_startup_heap()
    _announce(server, given)


def _announce(server, given: ServerSettings) -> None:
    """What the started server runs (``given``: the settings as the flags set them)."""
    from vlite.server.tool_calls import chosen_message

    info = server.engine.engine_info
    cache = f" (KV cache in {info.kv_cache_dtype})" if info.kv_cache_dtype else ""
    click.echo(f"attention backend: {info.attention_backend_name}{cache}", err=True)
    click.echo(f"quantization: {info.quantization}", err=True)
    for index, core in enumerate(server.engine.engine_infos):
        if core.memory_plan is not None:
            name = "memory" if len(server.engine.engine_infos) == 1 else f"memory (core {index})"
            click.echo(f"{name}: {core.memory_plan.describe()}", err=True)
    config = server.config
    budget = config.resolved_max_num_batched_tokens(info.max_model_len)
    chunking = "on" if config.enable_chunked_prefill else "off"
    click.echo(
        f"scheduler: {config.scheduler}, {budget} tokens per step, chunked prefill {chunking}",
        err=True,
    )
    infos = server.engine.engine_infos
    for index, core in enumerate(infos):
        name = "engine core" if len(infos) == 1 else f"engine core {index}"
        click.echo(
            f"{name}: pid {core.pid}, {core.num_kv_blocks} KV-cache blocks of "
            f"{core.block_size} tokens, max_model_len {core.max_model_len}",
            err=True,
        )
    chosen = server.settings.tool_call_parser
    if given.tool_call_parser is None and chosen is not None:
        click.echo(chosen_message(chosen), err=True)
    click.echo(
        f"vlite serving {server.served_model_name!r} at {server.address} "
        f"(OpenAI API under {server.address}/v1"
        f"{', API key required' if server.settings.api_key else ''})",
        err=True,
    )
