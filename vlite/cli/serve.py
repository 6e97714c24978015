"""``vlite serve``: the OpenAI-compatible HTTP server."""

from __future__ import annotations

import click

from vlite.cli.options import build_config, engine_options, pop_engine_overrides


@click.command("serve")
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option(
    "--port", type=int, default=8000, show_default=True, help="TCP port (0 picks a free one)."
)
@click.option(
    "--served-model-name",
    help="The model name clients send and /v1/models lists (default: the --model value).",
)
@click.option(
    "--log-level",
    type=click.Choice(["critical", "error", "warning", "info", "debug"]),
    default="info",
    show_default=True,
    help="Log level of the HTTP server.",
)
@engine_options
def serve_command(host, port, served_model_name, log_level, config_file, **options):
    """Serve the model over an OpenAI-compatible HTTP API.

    Endpoints: GET /health, GET /v1/models, POST /v1/completions and
    POST /v1/chat/completions ("stream": true streams server-sent events), GET /metrics
    (Prometheus). The engine core runs in its own process; Ctrl-C stops both.

    Unless told otherwise (--no-enable-chunked-prefill, VLITE_ENABLE_CHUNKED_PREFILL or a
    config file), the server chunks long prompts, with any --scheduler policy, under
    --max-num-batched-tokens 128 on CPU, 2048 on CUDA (unless set), so a new prompt does
    not stall the streams already running.

    \b
    Examples:
      vlite serve --port 8000
      curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
        -d '{"prompt": "The capital of France is", "max_tokens": 16, "temperature": 0}'
      curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\
        -d '{"messages": [{"role": "user", "content": "Hi"}], "stream": true}'
    """
    overrides = pop_engine_overrides(options)
    config = build_config(config_file, overrides)

    from vlite.engine.exceptions import EngineStartupError
    from vlite.server.api_server import ApiServer, bind_socket, with_serving_defaults

    config = with_serving_defaults(config, config_file, overrides)

    try:
        sock = bind_socket(host, port)
    except OSError as exc:
        raise click.ClickException(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    server = ApiServer(
        config,
        sock,
        served_model_name=served_model_name,
        log_level=log_level,
        on_ready=_announce,
    )
    try:
        server.run()
    except KeyboardInterrupt:
        pass
    except (EngineStartupError, ValueError, FileNotFoundError, ImportError) as exc:
        raise click.ClickException(str(exc)) from None
    finally:
        sock.close()
    click.echo("vlite server stopped", err=True)


def _announce(server) -> None:
    info = server.engine.engine_info
    click.echo(f"attention backend: {info.attention_backend_name}", err=True)
    click.echo(f"quantization: {info.quantization}", err=True)
    config = server.config
    budget = config.resolved_max_num_batched_tokens(info.max_model_len)
    chunking = "on" if config.enable_chunked_prefill else "off"
    click.echo(
        f"scheduler: {config.scheduler}, {budget} tokens per step, chunked prefill {chunking}",
        err=True,
    )
    click.echo(
        f"engine core: pid {info.pid}, {info.num_kv_blocks} KV-cache blocks of "
        f"{info.block_size} tokens, max_model_len {info.max_model_len}",
        err=True,
    )
    click.echo(
        f"vlite serving {server.served_model_name!r} at {server.address} "
        f"(OpenAI API under {server.address}/v1)",
        err=True,
    )
