"""``--reasoning-parser deepseek_r1`` without ``--structured-outputs-in-reasoning``: a
constraint (``response_format``, a forced tool call) applies to the answer only, so a
reply still in its reasoning is the model's own text, as it would be unconstrained. (The
grammar's side, with the reasoning forced: ``tests/e2e/test_structured_after_reasoning.py``.)
"""

from __future__ import annotations

import httpx
import pytest

from vlite.core.config import VliteConfig
from vlite.server.settings import ServerSettings
from vlite.testing.server_thread import running_server
from vlite.testing.tiny_models import make_tiny_model

MODEL_NAME = "tiny-llama"
TIMEOUT_S = 60
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
TOOL = {
    "type": "function",
    "function": {"name": "f", "parameters": {"type": "object", "properties": {}}},
}
CONSTRAINTS = {
    "response_format": {"response_format": {"type": "json_object"}},
    "structured_outputs": {"structured_outputs": {"choice": ["yes", "no"]}},
    "required_call": {"tools": [TOOL], "tool_choice": "required"},
    "named_call": {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "f"}}},
}


@pytest.fixture(scope="module")
def http(tmp_path_factory):
    model = make_tiny_model(tmp_path_factory.mktemp("reasoning-model"), "LlamaForCausalLM")
    config = VliteConfig(model=str(model), dtype="float32", num_kv_blocks=32, cpu_threads=1)
    settings = ServerSettings(
        served_model_name=MODEL_NAME, log_level="warning", reasoning_parser="deepseek_r1"
    )
    with (
        running_server(config, settings, TIMEOUT_S) as server,
        httpx.Client(base_url=server.address, timeout=TIMEOUT_S) as client,
    ):
        yield client


def reply(http: httpx.Client, **fields) -> dict:
    request = {"model": MODEL_NAME, "messages": ASK, "temperature": 0, "max_tokens": 12}
    response = http.post("/v1/chat/completions", json=request | {"ignore_eos": True} | fields)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


@pytest.mark.parametrize("constraint", list(CONSTRAINTS))
def test_the_reasoning_is_the_models_own_text_under_a_constraint(http, constraint):
    free = reply(http)["message"]
    assert free["reasoning_content"] and free["content"] is None  # it never closed </think>
    choice = reply(http, **CONSTRAINTS[constraint])
    assert choice["finish_reason"] == "length"
    message = choice["message"]
    assert message["reasoning_content"] == free["reasoning_content"]
    assert message["content"] is None and not message.get("tool_calls")
