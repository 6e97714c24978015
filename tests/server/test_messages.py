"""``POST /v1/messages`` with the official ``anthropic`` client, against a real server on a
tiny random model that needs an API key (this client sends its ``api_key`` as a bearer
token; older ones and other agents send ``x-api-key``, tested on its own below)."""

from __future__ import annotations

import json

import anthropic
import httpx
import jsonschema
import pytest

from vlite.core.config import VliteConfig
from vlite.server.anthropic_protocol import MessagesRequest
from vlite.server.errors import OpenAIError, anthropic_error
from vlite.server.messages_to_chat import chat_request
from vlite.server.serving_messages import stop_reason
from vlite.server.settings import ServerSettings
from vlite.testing.server_thread import running_server
from vlite.testing.tiny_models import make_tiny_model

MODEL_NAME = "tiny-llama"
API_KEY = "sk-messages-test"
TIMEOUT_S = 60
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
    "required": ["city"],
    "additionalProperties": False,
}
AUTH_MESSAGE = (
    "a valid API key is required: send 'Authorization: Bearer <key>' or 'x-api-key: <key>'"
)
WEATHER_TOOL = {"name": "get_weather", "description": "Weather", "input_schema": WEATHER_SCHEMA}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = make_tiny_model(tmp_path_factory.mktemp("messages-model"), "LlamaForCausalLM")
    config = VliteConfig(model=str(model), dtype="float32", num_kv_blocks=32, cpu_threads=1)
    settings = ServerSettings(
        served_model_name=MODEL_NAME,
        log_level="warning",
        tool_call_parser="hermes",
        api_key=(API_KEY,),
    )
    with running_server(config, settings, TIMEOUT_S) as api_server:
        yield api_server


@pytest.fixture(scope="module")
def client(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(
        base_url=server.address, api_key=API_KEY, timeout=TIMEOUT_S, max_retries=0
    )


@pytest.fixture(scope="module")
def http(server):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(base_url=server.address, timeout=TIMEOUT_S, headers=headers) as client:
        yield client


def prompt_tokens(http: httpx.Client, messages: list[dict], tools: list | None = None) -> int:
    """What ``/tokenize`` counts for these chat messages, as a chat request templates them."""
    body = {"messages": messages, "add_generation_prompt": True}
    if tools:
        body["tools"] = tools
    reply = http.post("/tokenize", json=body)
    assert reply.status_code == 200, reply.text
    return reply.json()["count"]


def test_a_text_reply_streamed_or_not_and_its_usage(client, http):
    request = {
        "model": MODEL_NAME,
        "max_tokens": 6,
        "extra_body": {"temperature": 0},  # the SDK's arguments no longer name it
        "system": "Be brief.",
        "messages": ASK,
    }
    whole = client.messages.create(**request)
    assert whole.id.startswith("msg_") and whole.type == "message" and whole.role == "assistant"
    assert whole.model == MODEL_NAME
    assert whole.stop_reason == "max_tokens" and whole.stop_sequence is None
    (block,) = whole.content
    assert block.type == "text" and block.text
    expected_input = prompt_tokens(http, [{"role": "system", "content": "Be brief."}, *ASK])
    assert whole.usage.input_tokens == expected_input
    assert whole.usage.output_tokens == 6

    with client.messages.stream(**request) as stream:
        streamed_text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed_text == block.text == final.content[0].text
    assert final.stop_reason == "max_tokens"
    assert (final.usage.input_tokens, final.usage.output_tokens) == (expected_input, 6)


def test_the_stream_is_anthropics_named_events(http):
    request = {"model": MODEL_NAME, "max_tokens": 3, "messages": ASK, "stream": True}
    with http.stream("POST", "/v1/messages", json=request) as reply:
        assert reply.status_code == 200
        lines = [line for line in reply.iter_lines() if line]
    names = [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]
    data = [json.loads(line.removeprefix("data: ")) for line in lines if line.startswith("data:")]
    assert [payload["type"] for payload in data] == names
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    assert "[DONE]" not in "".join(lines)
    assert data[-2]["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert data[-2]["usage"] == {"output_tokens": 3}
    assert data[-1]["timings"]["predicted_n"] == 3  # as every vlite stream's last event


def test_system_blocks_and_a_tool_use_conversation_are_templated(client, http):
    history = [
        *ASK,
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Let me check."},
                {
                    "type": "tool_use",
                    "id": "toolu_1",
                    "name": "get_weather",
                    "input": {"city": "Paris"},
                },
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
                {"type": "text", "text": "And tomorrow?"},
            ],
        },
    ]
    reply = client.messages.create(
        model=MODEL_NAME,
        max_tokens=2,
        system=[{"type": "text", "text": "Be brief."}],
        messages=history,
        tools=[WEATHER_TOOL],
        metadata={"user_id": "someone"},
    )
    assert reply.stop_reason in ("max_tokens", "end_turn", "tool_use")
    arguments = json.dumps({"city": "Paris"})
    call = {"id": "toolu_1", "type": "function"}
    call["function"] = {"name": "get_weather", "arguments": arguments}
    chat_history = [
        {"role": "system", "content": "Be brief."},
        *ASK,
        {"role": "assistant", "content": "Let me check.", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "toolu_1", "name": "get_weather", "content": "sunny"},
        {"role": "user", "content": "And tomorrow?"},
    ]
    chat_tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Weather",
                "parameters": WEATHER_SCHEMA,
            },
        }
    ]
    assert reply.usage.input_tokens == prompt_tokens(http, chat_history, chat_tools)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_forced_tool_is_a_tool_use_block_that_fits_its_schema(client, stream):
    request = {
        "model": MODEL_NAME,
        "max_tokens": 100,
        "extra_body": {"temperature": 0},
        "messages": ASK,
        "tools": [WEATHER_TOOL],
        "tool_choice": {"type": "tool", "name": "get_weather"},
    }
    if stream:
        with client.messages.stream(**request) as events:
            reply = events.get_final_message()
    else:
        reply = client.messages.create(**request)
    assert reply.stop_reason == "tool_use"
    (block,) = reply.content
    assert block.type == "tool_use" and block.name == "get_weather"
    assert block.id.startswith("toolu_")
    jsonschema.validate(block.input, WEATHER_SCHEMA)


@pytest.mark.parametrize(
    "body, param",
    [
        ({"model": MODEL_NAME, "messages": ASK}, "max_tokens"),
        (
            {
                "model": MODEL_NAME,
                "max_tokens": 4,
                "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}],
            },
            "messages.0.content.0",
        ),
        ({"model": MODEL_NAME, "max_tokens": 4, "messages": ASK, "thinking": {}}, "thinking"),
    ],
    ids=["no-max-tokens", "image-block", "unknown-field"],
)
def test_a_bad_request_is_a_400_in_anthropics_error_shape(client, body, param):
    with pytest.raises(anthropic.BadRequestError) as error:
        client.post("/v1/messages", body=body, cast_to=object)
    assert error.value.status_code == 400
    assert error.value.body["type"] == "error"
    assert error.value.body["error"]["type"] == "invalid_request_error"
    assert error.value.body["error"]["message"].startswith(param)


def test_another_model_is_anthropics_not_found_error(client):
    with pytest.raises(anthropic.NotFoundError) as error:
        client.messages.create(model="claude-nope", max_tokens=2, messages=ASK)
    assert error.value.body["error"]["type"] == "not_found_error"


def test_x_api_key_authenticates_and_a_wrong_key_is_refused(server):
    def client_with(headers: dict) -> anthropic.Anthropic:
        return anthropic.Anthropic(
            base_url=server.address, api_key=None, default_headers=headers, max_retries=0
        )

    reply = client_with({"x-api-key": API_KEY}).messages.create(
        model=MODEL_NAME, max_tokens=2, messages=ASK
    )
    assert reply.usage.output_tokens == 2
    with pytest.raises(anthropic.AuthenticationError) as error:
        client_with({"x-api-key": "wrong"}).messages.create(
            model=MODEL_NAME, max_tokens=2, messages=ASK
        )
    # The guard's refusal, in Anthropic's shape on its path.
    assert error.value.body == {
        "type": "error",
        "error": {"type": "authentication_error", "message": AUTH_MESSAGE},
    }
    for headers in ({"x-api-key": API_KEY}, {"Authorization": f"Bearer {API_KEY}"}):
        assert httpx.get(server.address + "/v1/models", headers=headers).status_code == 200
    refused = httpx.get(server.address + "/v1/models", headers={"x-api-key": "no"})
    assert refused.status_code == 401  # OpenAI's shape off Anthropic's path
    assert refused.json()["error"] == {
        "message": AUTH_MESSAGE,
        "type": "AuthenticationError",
        "param": None,
        "code": 401,
    }


def test_a_conversation_becomes_the_chat_request_it_means():
    request = MessagesRequest(
        model=MODEL_NAME,
        max_tokens=5,
        stop_sequences=["END"],
        top_k=3,
        system=[{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}],
        messages=[
            *ASK,
            {
                "role": "assistant",
                "content": [
                    {
                        "type": "tool_use",
                        "id": "toolu_1",
                        "name": "get_weather",
                        "input": {"city": "Rome"},
                    }
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_1",
                        "content": [{"type": "text", "text": "no such city"}],
                        "is_error": True,
                    }
                ],
            },
        ],
        tools=[WEATHER_TOOL],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
    )
    chat = chat_request(request)
    assert [message.model_dump(exclude_none=True) for message in chat.messages] == [
        {"role": "system", "content": "Be brief."},
        *ASK,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "toolu_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'},
                }
            ],
        },
        {
            "role": "tool",
            "content": "Error: no such city",
            "tool_call_id": "toolu_1",
            "name": "get_weather",
        },
    ]
    assert (chat.max_tokens, chat.stop, chat.top_k) == (5, ["END"], 3)
    assert chat.tool_choice == "required" and chat.parallel_tool_calls is False
    assert chat.tools[0].function.parameters == WEATHER_SCHEMA


@pytest.mark.parametrize(
    "choice, expected",
    [({"type": "auto"}, "auto"), ({"type": "none"}, "none"), ({"type": "any"}, "required")],
)
def test_tool_choice_types_map_to_chats(choice, expected):
    request = MessagesRequest(
        model=MODEL_NAME, max_tokens=1, messages=ASK, tools=[WEATHER_TOOL], tool_choice=choice
    )
    assert chat_request(request).tool_choice == expected


def test_a_tool_result_in_an_assistant_message_is_refused():
    request = MessagesRequest(
        model=MODEL_NAME,
        max_tokens=1,
        messages=[{"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t"}]}],
    )
    with pytest.raises(OpenAIError, match="cannot hold") as error:
        chat_request(request)
    assert error.value.param == "messages.0.content.0"


@pytest.mark.parametrize(
    "finish, stopped_by, expected",
    [
        ("stop", None, ("end_turn", None)),
        ("stop", "END", ("stop_sequence", "END")),
        ("stop", 7, ("end_turn", None)),
        ("length", None, ("max_tokens", None)),
        ("tool_calls", None, ("tool_use", None)),
    ],
)
def test_stop_reasons(finish, stopped_by, expected):
    assert stop_reason(finish, stopped_by) == expected


@pytest.mark.parametrize(
    "status, kind",
    [
        (400, "invalid_request_error"),
        (401, "authentication_error"),
        (404, "not_found_error"),
        (413, "request_too_large"),
        (408, "invalid_request_error"),
        (431, "invalid_request_error"),
        (500, "api_error"),
        (503, "overloaded_error"),
    ],
)
def test_errors_take_anthropics_types(status, kind):
    body = anthropic_error(OpenAIError("what went wrong", status)).model_dump()
    assert body == {"type": "error", "error": {"type": kind, "message": "what went wrong"}}
