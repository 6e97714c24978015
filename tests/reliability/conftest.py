"""The reliability suite: ``vlite serve`` as a child process, probed as a careful user
would before exposing it. Each test is bounded; each property gets its own test.

Fixtures: ``tiny_model`` (a random tiny Llama folder), ``slow_model`` (one whose answers
take seconds), ``server`` (one shared server with
two API keys, a 128-token context and 1-second header and body deadlines) and
``auth`` (headers carrying its first key).
"""

from __future__ import annotations

import pytest

from vlite.testing.server_process import ServerProcess
from vlite.testing.tiny_models import make_tiny_model

API_KEYS = ("first-key", "second-key")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    return str(make_tiny_model(tmp_path_factory.mktemp("reliability-model"), "LlamaForCausalLM"))


@pytest.fixture(scope="session")
def slow_model(tmp_path_factory) -> str:
    """A tiny model large enough that a 400-token answer takes seconds (about 15 ms a
    token on one thread): requests are still running when a test stops the server."""
    return str(
        make_tiny_model(
            tmp_path_factory.mktemp("reliability-slow-model"),
            "LlamaForCausalLM",
            hidden_size=512,
            intermediate_size=2048,
            num_hidden_layers=12,
            num_attention_heads=8,
            num_kv_heads=4,
        )
    )


@pytest.fixture(scope="session")
def server(tiny_model):
    server = ServerProcess(
        tiny_model,
        "--max-model-len", "128",
        "--num-kv-blocks", "64",
        "--cpu-threads", "1",
        "--header-timeout-s", "1",
        "--body-timeout-s", "1",
        "--max-n", "8",
        env={"VLITE_API_KEY": ",".join(API_KEYS)},
    )  # fmt: skip
    yield server
    server.kill()


@pytest.fixture(scope="session")
def auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {API_KEYS[0]}"}
