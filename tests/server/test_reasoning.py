"""``--reasoning-parser qwen3`` (with ``--tool-call-parser hermes``): a real server on a tiny
random model whose text is forced (a regex ``structured_outputs`` spelling out a reply with
``<think>...</think>``, which ``--structured-outputs-in-reasoning`` applies to the whole
reply), so that the parsers, not the model, are what is tested. Constraints on the answer
alone (the default): ``test_constraint_after_reasoning.py``."""

from __future__ import annotations

import json

import click
import httpx
import pytest

from vlite.cli.serve import _check_parsers
from vlite.core.config import VliteConfig
from vlite.core.errors import ConfigError
from vlite.server.reasoning import reasoning_parser_class
from vlite.server.settings import ServerSettings
from vlite.testing.server_thread import running_server
from vlite.testing.tiny_models import make_tiny_model

MODEL_NAME = "tiny-llama"
TIMEOUT_S = 60
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
REASONING = 'Maybe <tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>?'
ANSWER = 'Sure. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
THOUGHT_THEN_CALL = f"<think>{REASONING}</think>{ANSWER}"
THOUGHT_THEN_PROSE = "<think>Two and two.</think>It is 4."
NO_THOUGHT = "It is 4.</think>"
#: Characters a regex must escape to match itself.
REGEX_SPECIALS = set("\\.^$*+?()[]{}|")


def exactly(text: str) -> dict:
    """vLLM's extra-body ``structured_outputs`` forcing the output to be ``text``."""
    regex = "".join(f"\\{char}" if char in REGEX_SPECIALS else char for char in text)
    return {"structured_outputs": {"regex": regex}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = make_tiny_model(tmp_path_factory.mktemp("reasoning-model"), "LlamaForCausalLM")
    config = VliteConfig(model=str(model), dtype="float32", num_kv_blocks=32, cpu_threads=1)
    settings = ServerSettings(
        served_model_name=MODEL_NAME,
        log_level="warning",
        tool_call_parser="hermes",
        reasoning_parser="qwen3",
        structured_outputs_in_reasoning=True,
    )
    with running_server(config, settings, TIMEOUT_S) as api_server:
        yield api_server


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.address, timeout=TIMEOUT_S) as client:
        yield client


def body(text: str, tools: bool = True, **fields) -> dict:
    return {
        "model": MODEL_NAME,
        "messages": ASK,
        **({"tools": [WEATHER_TOOL]} if tools else {}),
        "temperature": 0,
        "max_tokens": 300,
        **exactly(text),
        **fields,
    }


def whole(http: httpx.Client, request: dict) -> dict:
    reply = http.post("/v1/chat/completions", json=request)
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]


def streamed(http: httpx.Client, request: dict) -> tuple[list[dict], str | None]:
    """The stream's choice deltas and its finish reason."""
    with http.stream("POST", "/v1/chat/completions", json={**request, "stream": True}) as reply:
        assert reply.status_code == 200, reply.read()
        lines = [line for line in reply.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]
    choices = [choice for chunk in chunks for choice in chunk["choices"]]
    reasons = [choice["finish_reason"] for choice in choices if choice["finish_reason"]]
    assert len(reasons) == 1
    return [choice["delta"] for choice in choices], reasons[0]


def assembled(deltas: list[dict]) -> tuple[str, str, list[tuple[str, dict]]]:
    """Reasoning, content and ``(name, arguments)`` of each call, put together from stream
    deltas, checking that no reasoning comes after content or a call began."""
    reasoning, content, calls, answered = "", "", {}, False
    for delta in deltas:
        if delta.get("reasoning_content"):
            assert not answered, f"reasoning after the answer began: {delta}"
            reasoning += delta["reasoning_content"]
        answered = answered or bool(delta.get("content") or delta.get("tool_calls"))
        content += delta.get("content") or ""
        for call in delta.get("tool_calls", []):
            entry = calls.setdefault(call["index"], [call["function"].get("name"), ""])
            entry[1] += call["function"].get("arguments", "")
    return reasoning, content, [(name, json.loads(args)) for name, args in calls.values()]


def test_reasoning_is_split_off_and_only_the_answers_call_is_a_call(http):
    choice = whole(http, body(THOUGHT_THEN_CALL))
    message = choice["message"]
    assert message["reasoning_content"] == REASONING
    assert message["content"] == "Sure."
    (call,) = message["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    assert choice["finish_reason"] == "tool_calls"


def test_streamed_reasoning_content_and_calls_equal_the_whole_reply(http):
    message = whole(http, body(THOUGHT_THEN_CALL))["message"]
    deltas, reason = streamed(http, body(THOUGHT_THEN_CALL))
    assert reason == "tool_calls"
    calls = [
        (call["function"]["name"], json.loads(call["function"]["arguments"]))
        for call in message["tool_calls"]
    ]
    assert assembled(deltas) == (message["reasoning_content"], message["content"], calls)
    assert not any("think>" in json.dumps(delta) for delta in deltas)


@pytest.mark.parametrize("tools", [False, True], ids=["no-tools", "tools"])
def test_prose_after_reasoning_is_the_content_streamed_or_not(http, tools):
    message = whole(http, body(THOUGHT_THEN_PROSE, tools=tools))["message"]
    assert (message["reasoning_content"], message["content"]) == ("Two and two.", "It is 4.")
    assert not message.get("tool_calls")
    deltas, reason = streamed(http, body(THOUGHT_THEN_PROSE, tools=tools))
    assert reason == "stop" and assembled(deltas) == ("Two and two.", "It is 4.", [])


def test_a_reply_without_think_has_no_reasoning(http):
    message = whole(http, body(NO_THOUGHT, tools=False))["message"]
    assert message["reasoning_content"] is None and message["content"] == NO_THOUGHT
    deltas, _ = streamed(http, body(NO_THOUGHT, tools=False))
    assert assembled(deltas) == ("", NO_THOUGHT, [])


def test_a_reply_cut_off_in_its_reasoning_is_reasoning_only(http):
    choice = whole(http, body(THOUGHT_THEN_PROSE, tools=False, max_tokens=10))
    assert choice["finish_reason"] == "length" and choice["message"]["content"] is None
    assert "Two and two.".startswith(choice["message"]["reasoning_content"])


def test_the_completions_endpoint_is_not_split(http):
    request = {"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 300}
    request |= exactly(THOUGHT_THEN_PROSE)
    reply = http.post("/v1/completions", json=request).json()
    assert reply["choices"][0]["text"] == THOUGHT_THEN_PROSE


def test_an_unknown_parser_is_refused_naming_the_registered_ones():
    with pytest.raises(ConfigError, match="--reasoning-parser 'nope'.*deepseek_r1, qwen3"):
        reasoning_parser_class("nope")
    with pytest.raises(click.ClickException, match="registered: deepseek_r1, qwen3"):
        _check_parsers(ServerSettings(reasoning_parser="nope"))
    _check_parsers(ServerSettings(reasoning_parser="deepseek_r1"))
