"""Structured outputs through the official ``openai`` client against ``vlite serve`` on the
default model: twenty JSON schemas (every reply parses and validates), choices, a regex, tool
calls (``tool_choice="required"`` and a named function, streamed and not), vLLM's
``structured_outputs`` with the second backend, ``logit_bias``, and the 400s."""

from __future__ import annotations

import json
import re
import signal
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai
import pytest

from vlite.bench.json_schemas import SCHEMAS, schema_prompt
from vlite.testing.server_process import ServerProcess

TIMEOUT_S = 240
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME_TOOL = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "maxLength": 12}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server():
    server = ServerProcess(None, "--max-model-len", "1024", "--max-num-seqs", "32")
    yield server
    server.signal(signal.SIGTERM)
    try:
        assert server.wait(60) == 0, server.log_text
    finally:
        server.kill()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.address + "/v1", api_key="unused", timeout=TIMEOUT_S)


def chat(client: openai.OpenAI, content: str, **options):
    return client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=[{"role": "user", "content": content}],
        temperature=0,
        max_tokens=300,
        **options,
    )


def test_twenty_schemas_give_json_that_validates(client):
    def ask(case):
        subject, schema = case
        response_format = {
            "type": "json_schema",
            "json_schema": {"name": "answer", "schema": schema, "strict": True},
        }
        return chat(client, schema_prompt(subject), response_format=response_format)

    with ThreadPoolExecutor(len(SCHEMAS)) as pool:  # all in one batch
        replies = list(pool.map(ask, SCHEMAS))

    for (subject, schema), reply in zip(SCHEMAS, replies):
        choice = reply.choices[0]
        assert choice.finish_reason == "stop", (subject, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), schema)


def test_json_object_and_the_second_backend(client):
    reply = chat(client, "Give me a JSON object.", response_format={"type": "json_object"})
    assert isinstance(json.loads(reply.choices[0].message.content), dict)

    subject, schema = SCHEMAS[4]
    reply = chat(
        client,
        schema_prompt(subject),
        extra_body={"structured_outputs": {"json": schema, "backend": "llguidance"}},
    )
    jsonschema.validate(json.loads(reply.choices[0].message.content), schema)


def test_choices_and_regexes_through_the_completions_endpoint(client):
    model = client.models.list().data[0].id
    choices = ["positive", "negative", "neutral"]
    reply = client.completions.create(
        model=model,
        prompt="The review 'I loved it!' is",
        max_tokens=10,
        temperature=0,
        extra_body={"structured_outputs": {"choice": choices}},
    )
    assert reply.choices[0].text in choices

    reply = client.completions.create(
        model=model,
        prompt="Call me at",
        max_tokens=20,
        temperature=0,
        extra_body={"structured_outputs": {"regex": r"\(\d{3}\) \d{3}-\d{4}"}},
    )
    assert re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", reply.choices[0].text)


def streamed_tool_calls(client, **options) -> dict[int, dict]:
    """The tool calls of a streamed reply, put together from their deltas."""
    calls: dict[int, dict] = {}
    finish = None
    stream = client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=ASK,
        temperature=0,
        max_tokens=200,
        stream=True,
        **options,
    )
    for chunk in stream:
        choice = chunk.choices[0]
        for delta in choice.delta.tool_calls or []:
            call = calls.setdefault(delta.index, {"name": None, "arguments": "", "id": None})
            call["id"] = call["id"] or delta.id
            call["name"] = call["name"] or delta.function.name
            call["arguments"] += delta.function.arguments or ""
        finish = choice.finish_reason or finish
    assert finish == "tool_calls"
    return calls


@pytest.mark.parametrize(
    "tool_choice",
    ["required", {"type": "function", "function": {"name": "get_weather"}}],
    ids=["required", "named"],
)
def test_tool_calls_validate_and_stream_the_same(client, tool_choice):
    reply = client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=ASK,
        temperature=0,
        max_tokens=200,
        tools=[WEATHER_TOOL, TIME_TOOL],
        tool_choice=tool_choice,
    )

    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = choice.message.tool_calls
    assert calls and all(call.type == "function" and call.id for call in calls)
    by_name = {"get_weather": WEATHER_TOOL, "get_time": TIME_TOOL}
    for call in calls:
        schema = by_name[call.function.name]["function"]["parameters"]
        jsonschema.validate(json.loads(call.function.arguments), schema)
    if isinstance(tool_choice, dict):
        assert [call.function.name for call in calls] == ["get_weather"]

    streamed = streamed_tool_calls(client, tools=[WEATHER_TOOL, TIME_TOOL], tool_choice=tool_choice)
    assert [(c["name"], json.loads(c["arguments"])) for c in streamed.values()] == [
        (call.function.name, json.loads(call.function.arguments)) for call in calls
    ]


def test_a_streamed_json_reply_equals_the_whole_one(client):
    subject, schema = SCHEMAS[12]
    response_format = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    whole = chat(client, schema_prompt(subject), response_format=response_format)

    stream = client.chat.completions.create(
        model=client.models.list().data[0].id,
        messages=[{"role": "user", "content": schema_prompt(subject)}],
        temperature=0,
        max_tokens=300,
        response_format=response_format,
        stream=True,
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)

    assert text == whole.choices[0].message.content


def test_logit_bias_forces_a_token(client):
    model = client.models.list().data[0].id
    reply = client.completions.create(
        model=model, prompt="Hello", max_tokens=4, temperature=0, logit_bias={"1234": 100}
    )
    tokens = client.completions.create(
        model=model, prompt="Hello", max_tokens=4, temperature=0, logprobs=0,
        logit_bias={"1234": 100},
    ).choices[0].logprobs.tokens  # fmt: skip
    assert len(tokens) == 4 and len(set(tokens)) == 1, (reply.choices[0].text, tokens)


@pytest.mark.parametrize(
    ("options", "param", "message"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "nope"}},
                }
            },  # noqa: E501
            "structured_outputs.json",
            "invalid json constraint",
        ),
        (
            {"extra_body": {"structured_outputs": {"regex": "a(b"}}},
            "structured_outputs.regex",
            "invalid regex",
        ),  # noqa: E501
        (
            {"extra_body": {"structured_outputs": {"regex": "a", "choice": ["b"]}}},
            "structured_outputs",
            "exactly one",
        ),  # noqa: E501
        ({"tools": [WEATHER_TOOL]}, "tool_choice", "tool_choice 'auto'"),
        (
            {
                "tools": [WEATHER_TOOL],
                "tool_choice": {"type": "function", "function": {"name": "nope"}},
            },
            "tool_choice",
            "not among the tools",
        ),  # noqa: E501
        ({"logit_bias": {"x": 1}}, "logit_bias", "keys must be token ids"),
        ({"logit_bias": {"99999999": 1}}, None, "outside the model's vocabulary"),
    ],
    ids=[
        "bad-schema",
        "bad-regex",
        "two-constraints",
        "auto-tools",
        "unknown-function",
        "bad-bias-key",
        "bias-id",
    ],  # noqa: E501
)
def test_bad_constraints_are_400s_naming_the_field(client, options, param, message):
    with pytest.raises(openai.BadRequestError) as error:
        chat(client, "Hi", **options)

    body = error.value.body
    assert message in body["message"], body
    if param is not None:
        assert body["param"] == param
