"""ServerSettings: how ``vlite serve`` listens, authenticates, limits and shuts down.

The HTTP server's own settings, beside the engine's :class:`~vlite.core.config.VliteConfig`
and read the same way: defaults < ``VLITE_*`` environment variables < flags (``vlite serve
--help`` lists them, generated from these fields). Every limit has a default that a
well-behaved client never meets; each is enforced before a request reaches the engine.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from vlite.core.config import ENV_PREFIX
from vlite.engine.data_parallel_client import DATA_PARALLEL_BACKENDS

MIB = 1 << 20


class ServerSettings(BaseSettings):
    """The HTTP server's settings. Invalid values raise at construction, naming the field."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="forbid", frozen=True)

    host: str = Field("127.0.0.1", description="Address to listen on (loopback by default).")
    port: int = Field(8000, ge=0, le=65535, description="TCP port (0 picks a free one).")
    served_model_name: str | None = Field(
        None, description="The model name clients send and /v1/models lists; default: --model."
    )
    log_level: Literal["critical", "error", "warning", "info", "debug"] = Field(
        "info", description="Log level of the HTTP server."
    )
    api_key: Annotated[tuple[str, ...], NoDecode] = Field(
        (),
        description="Require 'Authorization: Bearer KEY' on /v1/* (repeatable; "
        "VLITE_API_KEY takes a comma-separated list). /health and /metrics stay open.",
    )
    protect_metrics: bool = Field(False, description="Require the API key on /metrics too.")
    max_request_bytes: int = Field(
        8 * MIB, ge=1024, description="Largest request body; a larger one is answered 413."
    )
    max_n: int = Field(128, ge=1, description="Most samples (n) one request may ask for.")
    max_stop_strings: int = Field(64, ge=0, description="Most stop strings in one request.")
    max_stop_string_chars: int = Field(512, ge=1, description="Longest stop string, in characters.")
    header_timeout_s: float = Field(
        10.0, gt=0, description="Seconds a client gets to send a request's headers."
    )
    body_timeout_s: float = Field(
        30.0, gt=0, description="Seconds a client may pause while sending a request's body."
    )
    keep_alive_timeout_s: float = Field(
        5.0, gt=0, description="Seconds an idle keep-alive connection stays open."
    )
    max_header_bytes: int = Field(
        64 * 1024, ge=1024, description="Largest request line plus headers, in bytes."
    )
    max_headers: int = Field(100, ge=8, description="Most header fields in one request.")
    data_parallel_size: int = Field(
        1,
        ge=1,
        description="Engine-core processes behind this server (data parallelism), each a "
        "whole engine on the same model with its own workers (--tp); each new request goes "
        "to the least-loaded one. Unless --cpu-threads is set, they share the cores; on "
        "GPUs each core gets its own (tp x pp each).",
    )
    data_parallel_backend: Literal[DATA_PARALLEL_BACKENDS] = Field(
        "mp",
        description="Where the engine cores run: 'mp', local processes; 'ray', Ray actors "
        "spread over the cluster's nodes (connects to --ray-address; needs vlite[ray]).",
    )
    data_parallel_resources: Annotated[tuple[str, ...], NoDecode] = Field(
        (),
        description="With --data-parallel-backend ray: a custom Ray resource NAME=AMOUNT "
        "each core's actor reserves besides its threads or GPUs (repeatable; "
        "VLITE_DATA_PARALLEL_RESOURCES takes a comma-separated list).",
    )
    tool_call_parser: str | None = Field(
        None,
        description="The tool-call parser (a registered tool_parser plugin: built in, "
        "hermes, llama3_json, mistral, pythonic) that reads the model's calls, so that "
        "chat requests with tools and tool_choice 'auto' (the default with tools) get "
        "message.tool_calls. Default: the one parser whose template markers the model's "
        "chat template all contains (printed at start), if exactly one does; 'none': no "
        "parser. Without one, 'auto' is a 400.",
    )
    reasoning_parser: str | None = Field(
        None,
        description="The reasoning parser (a registered reasoning_parser plugin: built in, "
        "deepseek_r1, qwen3) that splits a thinking model's chat replies: the reasoning "
        "goes out as message.reasoning_content (streamed as delta.reasoning_content), the "
        "answer after it as content, and only the answer is read for tool calls.",
    )
    structured_outputs_in_reasoning: bool = Field(
        False,
        description="With --reasoning-parser: constrain the whole reply, reasoning "
        "included, by response_format, structured_outputs and forced tool calls (vLLM's "
        "enable_in_reasoning). Off (the default): the reasoning runs free and the "
        "constraint applies to the answer after it.",
    )
    shutdown_timeout_s: float = Field(
        30.0,
        ge=0,
        description="On SIGTERM: seconds running requests get to finish before their "
        "streams are ended with an error event.",
    )

    @field_validator("api_key", "data_parallel_resources", mode="before")
    @classmethod
    def _split_lists(cls, value: object) -> object:
        if isinstance(value, str):
            return tuple(key.strip() for key in value.split(",") if key.strip())
        return value

    @field_validator("api_key")
    @classmethod
    def _keys_are_not_blank(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if any(not key.strip() for key in value):
            raise ValueError("an API key must not be empty")
        return value

    @model_validator(mode="after")
    def _resources_need_ray(self) -> ServerSettings:
        if self.data_parallel_resources and self.data_parallel_backend != "ray":
            raise ValueError(
                f"data_parallel_resources {list(self.data_parallel_resources)} are Ray "
                "resources: they need data_parallel_backend 'ray' (it is "
                f"{self.data_parallel_backend!r})"
            )
        return self
