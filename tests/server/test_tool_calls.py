"""``tool_choice="auto"`` with ``--tool-call-parser hermes``: a real server on a tiny random
model whose text is forced (a regex ``structured_outputs`` spelling out a Hermes call, or
prose), so that the parser, not the model, is what is tested."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from vlite.core.config import VliteConfig
from vlite.core.errors import ConfigError
from vlite.server.errors import OpenAIError
from vlite.server.output_constraints import tool_plan
from vlite.server.protocol import ChatCompletionRequest
from vlite.server.settings import ServerSettings
from vlite.server.tool_calls import tool_parser_class
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
CALL_TEXT = (
    'Let me check. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
)
PROSE = "It is sunny, {maybe}."
#: Characters a regex must escape to match itself.
REGEX_SPECIALS = set("\\.^$*+?()[]{}|")


def exactly(text: str) -> dict:
    """vLLM's extra-body ``structured_outputs`` forcing the output to be ``text``."""
    regex = "".join(f"\\{char}" if char in REGEX_SPECIALS else char for char in text)
    return {"structured_outputs": {"regex": regex}}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = make_tiny_model(tmp_path_factory.mktemp("tool-model"), "LlamaForCausalLM")
    config = VliteConfig(model=str(model), dtype="float32", num_kv_blocks=32, cpu_threads=1)
    settings = ServerSettings(
        served_model_name=MODEL_NAME, log_level="warning", tool_call_parser="hermes"
    )
    with running_server(config, settings, TIMEOUT_S) as api_server:
        yield api_server


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.address + "/v1", api_key="unused", timeout=TIMEOUT_S)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.address, timeout=TIMEOUT_S) as client:
        yield client


def body(text: str, **fields) -> dict:
    return {
        "model": MODEL_NAME,
        "messages": ASK,
        "tools": [WEATHER_TOOL],
        "temperature": 0,
        "max_tokens": 200,
        **exactly(text),
        **fields,
    }


def through_client(client: openai.OpenAI, request: dict, **options):
    """``request`` sent with the official client (vLLM's field as ``extra_body``)."""
    request = dict(request)
    extra_body = {"structured_outputs": request.pop("structured_outputs")}
    return client.chat.completions.create(**request, **options, extra_body=extra_body)


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


def assembled(deltas: list[dict]) -> tuple[str, list[tuple[str, str]]]:
    """Content and ``(name, arguments)`` of each call, put together from stream deltas
    (checking each call's id, type and name come once, in its first delta)."""
    content, calls = "", {}
    for delta in deltas:
        content += delta.get("content") or ""
        for call in delta.get("tool_calls", []):
            function = call["function"]
            if call["index"] not in calls:
                assert call["id"].startswith("call_") and call["type"] == "function"
                calls[call["index"]] = [function["name"], function.get("arguments", "")]
            else:
                assert "id" not in call and "name" not in function
                calls[call["index"]][1] += function.get("arguments", "")
    return content, [tuple(calls[index]) for index in sorted(calls)]


def test_a_hermes_call_is_a_tool_call_through_the_openai_client(client):
    reply = through_client(client, body(CALL_TEXT))
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check."
    (call,) = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}


@pytest.mark.parametrize("tool_choice", [None, "auto"], ids=["default", "auto"])
def test_streamed_calls_equal_the_whole_reply_and_no_marker_is_content(http, tool_choice):
    fields = {} if tool_choice is None else {"tool_choice": tool_choice}
    whole = http.post("/v1/chat/completions", json=body(CALL_TEXT, **fields)).json()
    message = whole["choices"][0]["message"]
    expected_calls = [
        (call["function"]["name"], call["function"]["arguments"]) for call in message["tool_calls"]
    ]
    deltas, reason = streamed(http, body(CALL_TEXT, **fields))
    assert reason == "tool_calls" == whole["choices"][0]["finish_reason"]
    content, calls = assembled(deltas)
    assert (content, calls) == (message["content"], expected_calls)
    assert not any("tool_call" in (delta.get("content") or "") for delta in deltas)


def test_prose_stays_content_streamed_or_not(http):
    whole = http.post("/v1/chat/completions", json=body(PROSE)).json()["choices"][0]
    assert whole["message"]["content"] == PROSE and not whole["message"].get("tool_calls")
    assert whole["finish_reason"] == "stop"
    deltas, reason = streamed(http, body(PROSE))
    assert reason == "stop" and assembled(deltas) == (PROSE, [])


def test_a_call_cut_off_by_max_tokens_comes_back_as_content(http):
    reply = http.post("/v1/chat/completions", json=body(CALL_TEXT, max_tokens=12)).json()
    choice = reply["choices"][0]
    assert choice["finish_reason"] == "length" and not choice["message"].get("tool_calls")
    assert CALL_TEXT.startswith(choice["message"]["content"])


def test_tool_results_in_the_conversation_are_accepted(client):
    history = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_abc",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_abc", "content": "sunny, 20 C"},
    ]
    reply = through_client(client, {**body(PROSE), "messages": history}, tool_choice="auto")
    assert reply.choices[0].message.content == PROSE


def test_auto_without_a_parser_is_a_400_naming_the_flag():
    request = ChatCompletionRequest(messages=ASK, tools=[WEATHER_TOOL])
    with pytest.raises(OpenAIError) as error:
        tool_plan(request)
    assert "--tool-call-parser" in str(error.value) and error.value.param == "tool_choice"
    assert tool_plan(request, has_parser=True).parses_calls


def test_an_unknown_parser_is_refused_naming_the_registered_ones():
    with pytest.raises(ConfigError, match="--tool-call-parser 'nope'.*hermes, llama3_json"):
        tool_parser_class("nope")


def test_vlite_serve_refuses_an_unknown_parser_before_the_engine_starts():
    import click

    from vlite.cli.serve import _check_parsers

    with pytest.raises(click.ClickException, match="registered: hermes, llama3_json"):
        _check_parsers(ServerSettings(tool_call_parser="nope"))
    _check_parsers(ServerSettings(tool_call_parser="pythonic"))
