"""``tool_choice="auto"`` with the ``hermes`` parser, chosen from the chat template (which
names ``<tool_call>``; the other servers in these tests name it with ``--tool-call-parser``):
a real server on a tiny random model whose text is forced (a regex ``structured_outputs``
spelling out a Hermes call, or prose), so that the parser, not the model, is what is
tested."""

from __future__ import annotations

import json
import logging

import httpx
import openai
import pytest

from vlite.core.config import VliteConfig
from vlite.core.errors import ConfigError
from vlite.server.errors import OpenAIError
from vlite.server.output_constraints import tool_plan
from vlite.server.protocol import ChatCompletionRequest
from vlite.server.serving_chat import ChatServing
from vlite.server.settings import ServerSettings
from vlite.server.tool_calls import (
    parser_from_template,
    tool_parser_class,
    with_template_tool_parser,
)
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
    template = model / "chat_template.jinja"  # Hermes' markers, in a comment
    template.write_text("{#- calls: <tool_call>{...}</tool_call> -#}" + template.read_text())
    config = VliteConfig(model=str(model), dtype="float32", num_kv_blocks=32, cpu_threads=1)
    settings = ServerSettings(served_model_name=MODEL_NAME, log_level="warning")
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


def test_a_hermes_call_is_a_tool_call_through_the_openai_client(server, client):
    assert server.settings.tool_call_parser == "hermes"  # chosen from the template
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
    _check_parsers(ServerSettings(tool_call_parser="none"))  # no parser at all


QWEN_LIKE = (
    "{%- if tools %}For each function call, return a json object within <tool_call>"
    "</tool_call> XML tags:\n<tool_call>\n{...}\n</tool_call>{% endif %}"
)
LLAMA_LIKE = (
    "Given the following functions, please respond with a JSON for a function call with "
    "its proper arguments that best answers the given prompt."
)


@pytest.mark.parametrize(
    "template, expected",
    [
        (QWEN_LIKE, "hermes"),
        ({"default": "{{ messages }}", "tool_use": QWEN_LIKE}, "hermes"),  # named ones
        (LLAMA_LIKE, "llama3_json"),
        ('{{ "[TOOL_CALLS] [" }}', "mistral"),
        ("<tool_call> alone, without its closing tag", None),  # all markers, or none
        ("{% for message in messages %}{{ message.content }}{% endfor %}", None),
        (QWEN_LIKE + "[TOOL_CALLS]", None),  # two parsers' markers: ambiguous
        (None, None),
    ],
)
def test_the_parser_is_chosen_from_a_chat_template_only_when_unambiguous(template, expected):
    assert parser_from_template(template) == expected


def test_a_named_parser_or_none_overrides_the_template(caplog):
    class Tokenizer:
        chat_template = QWEN_LIKE

        def get_vocab(self) -> dict[str, int]:
            return {"a": 0}

    class Engine:
        max_model_len = 16

        def get_tokenizer(self) -> Tokenizer:
            return Tokenizer()

    with caplog.at_level(logging.INFO, logger="vlite.server.tool_calls"):
        chosen = with_template_tool_parser(ServerSettings(), Tokenizer())
    assert chosen.tool_call_parser == "hermes"
    assert caplog.messages == [
        "tool-call parser 'hermes' chosen from the chat template; --tool-call-parser overrides"
    ]
    for name in ("pythonic", "none"):
        given = ServerSettings(tool_call_parser=name)
        assert with_template_tool_parser(given, Tokenizer()) is given
    assert with_template_tool_parser(ServerSettings(), object()).tool_call_parser is None
    off = ChatServing(Engine(), MODEL_NAME, ServerSettings(tool_call_parser="none"))
    assert off.tool_parser_cls is None  # and 'auto' is the 400 above
