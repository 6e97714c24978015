"""``POST /v1/responses`` with the official ``openai`` client's ``client.responses``,
against a real server on a tiny random model (``--tool-call-parser hermes``)."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from vlite.core.config import VliteConfig
from vlite.server.responses_protocol import ResponsesRequest
from vlite.server.responses_to_chat import chat_request
from vlite.server.serving_responses import response_status
from vlite.server.settings import ServerSettings
from vlite.testing.server_thread import running_server
from vlite.testing.tiny_models import make_tiny_model

MODEL_NAME = "tiny-llama"
TIMEOUT_S = 60
QUESTION = "What is the weather in Paris?"
ASK = [{"role": "user", "content": QUESTION}]
WEATHER_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
    "required": ["city"],
    "additionalProperties": False,
}
WEATHER_TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather",
    "parameters": WEATHER_SCHEMA,
}
CHAT_TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER_SCHEMA},
    }
]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = make_tiny_model(tmp_path_factory.mktemp("responses-model"), "LlamaForCausalLM")
    config = VliteConfig(model=str(model), dtype="float32", num_kv_blocks=32, cpu_threads=1)
    settings = ServerSettings(
        served_model_name=MODEL_NAME, log_level="warning", tool_call_parser="hermes"
    )
    with running_server(config, settings, TIMEOUT_S) as api_server:
        yield api_server


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{server.address}/v1", api_key="unused", timeout=TIMEOUT_S, max_retries=0
    )


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.address, timeout=TIMEOUT_S) as client:
        yield client


def prompt_tokens(http: httpx.Client, messages: list[dict], tools: list | None = None) -> int:
    """What ``/tokenize`` counts for these chat messages, as a chat request templates them."""
    body = {"messages": messages, "add_generation_prompt": True}
    if tools:
        body["tools"] = tools
    reply = http.post("/tokenize", json=body)
    assert reply.status_code == 200, reply.text
    return reply.json()["count"]


def streamed(client: openai.OpenAI, **request) -> list:
    """The events of a streamed request, checked for their numbering."""
    events = list(client.responses.create(stream=True, **request))
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert [event.type for event in events[:2]] == ["response.created", "response.in_progress"]
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    return events


@pytest.mark.parametrize(
    "request_fields, chat_messages",
    [
        ({"input": QUESTION}, ASK),
        (
            {
                "instructions": "Be brief.",
                "input": [
                    {"role": "developer", "content": "Answer in French."},
                    {"role": "user", "content": [{"type": "input_text", "text": QUESTION}]},
                ],
            },
            [
                {"role": "system", "content": "Be brief."},
                {"role": "system", "content": "Answer in French."},
                *ASK,
            ],
        ),
    ],
    ids=["text", "items-and-instructions"],
)
def test_a_text_reply_streamed_or_not_cut_by_max_output_tokens(
    client, http, request_fields, chat_messages
):
    request = {"model": MODEL_NAME, "max_output_tokens": 6, "temperature": 0, **request_fields}
    whole = client.responses.create(**request)
    assert whole.id.startswith("resp_") and whole.object == "response"
    assert whole.model == MODEL_NAME
    assert whole.status == "incomplete"
    assert whole.incomplete_details.reason == "max_output_tokens"
    (item,) = whole.output
    assert item.type == "message" and item.role == "assistant" and item.id.startswith("msg_")
    (part,) = item.content
    assert part.type == "output_text" and part.text == whole.output_text != ""
    expected_input = prompt_tokens(http, chat_messages)
    usage = whole.usage
    assert (usage.input_tokens, usage.output_tokens) == (expected_input, 6)
    assert usage.total_tokens == expected_input + 6

    events = streamed(client, **request)
    deltas = [event.delta for event in events if event.type == "response.output_text.delta"]
    assert "".join(deltas) == whole.output_text
    types = [event.type for event in events]
    assert types[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert types[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    final = events[-1].response
    assert final.output_text == whole.output_text
    assert final.incomplete_details.reason == "max_output_tokens"
    assert (final.usage.input_tokens, final.usage.output_tokens) == (expected_input, 6)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_forced_function_is_a_function_call_item_that_fits_its_schema(client, stream):
    request = {
        "model": MODEL_NAME,
        "max_output_tokens": 100,
        "temperature": 0,
        "input": QUESTION,
        "tools": [WEATHER_TOOL],
        "tool_choice": {"type": "function", "name": "get_weather"},
    }
    if stream:
        events = streamed(client, **request)
        reply = events[-1].response
        assert events[-1].type == "response.completed"
        deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
        (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
        assert "".join(deltas) == done.arguments
    else:
        reply = client.responses.create(**request)
    assert reply.status == "completed" and reply.incomplete_details is None
    (call,) = reply.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert call.id.startswith("fc_") and call.call_id.startswith("call_")
    assert call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), WEATHER_SCHEMA)
    assert reply.tools[0].name == "get_weather"
    assert reply.tool_choice.name == "get_weather"


def test_a_function_call_and_its_output_are_templated(client, http):
    arguments = json.dumps({"city": "Paris"})
    reply = client.responses.create(
        model=MODEL_NAME,
        max_output_tokens=2,
        input=[
            *ASK,
            {
                "type": "function_call",
                "call_id": "call_1",
                "name": "get_weather",
                "arguments": arguments,
            },
            {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
            {"role": "user", "content": "And tomorrow?"},
        ],
        tools=[WEATHER_TOOL],
        store=False,
        metadata={"user": "someone"},
    )
    assert reply.status in ("completed", "incomplete")
    call = {"id": "call_1", "type": "function"}
    call["function"] = {"name": "get_weather", "arguments": arguments}
    chat_history = [
        *ASK,
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "sunny"},
        {"role": "user", "content": "And tomorrow?"},
    ]
    assert reply.usage.input_tokens == prompt_tokens(http, chat_history, CHAT_TOOLS)


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"store": True}, "store"),
        ({"previous_response_id": "resp_123"}, "previous_response_id"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input.0"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image"}]}]},
            "input.0.content.0.type",
        ),
        ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
        ({"background": True}, "background"),
    ],
    ids=["store", "previous-response-id", "reasoning-item", "image", "built-in-tool", "unknown"],
)
def test_what_cannot_be_honoured_is_a_400_naming_the_field(client, fields, param):
    request = {"model": MODEL_NAME, "input": QUESTION, "max_output_tokens": 2, **fields}
    with pytest.raises(openai.BadRequestError) as error:
        client.post("/responses", body=request, cast_to=object)
    assert error.value.status_code == 400
    assert error.value.body["param"] == param
    assert error.value.body["message"].startswith(param.split(".")[0])


def test_another_model_is_a_404(client):
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="gpt-nope", input=QUESTION, max_output_tokens=2)


def test_items_become_the_chat_request_they_mean():
    request = ResponsesRequest.model_validate(
        {
            "model": MODEL_NAME,
            "instructions": "Be brief.",
            "input": [
                {"type": "message", "role": "developer", "content": "Use tools."},
                *ASK,
                {
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": "Checking.", "annotations": []}],
                },
                {
                    "type": "function_call",
                    "call_id": "c1",
                    "name": "get_weather",
                    "arguments": "{}",
                },
                {
                    "type": "function_call",
                    "call_id": "c2",
                    "name": "get_weather",
                    "arguments": "{}",
                },
                {"type": "function_call_output", "call_id": "c2", "output": "rain"},
            ],
            "max_output_tokens": 7,
            "tools": [WEATHER_TOOL],
            "tool_choice": "required",
            "parallel_tool_calls": False,
        }
    )
    chat = chat_request(request)
    messages = [message.model_dump(exclude_none=True) for message in chat.messages]
    assert [message["role"] for message in messages] == [
        "system",
        "system",
        "user",
        "assistant",
        "tool",
    ]
    assert messages[3]["content"] == "Checking."
    assert [call["id"] for call in messages[3]["tool_calls"]] == ["c1", "c2"]
    assert messages[4] == {
        "role": "tool",
        "content": "rain",
        "tool_call_id": "c2",
        "name": "get_weather",
    }
    assert chat.max_tokens == 7 and chat.tool_choice == "required"
    assert chat.parallel_tool_calls is False
    assert chat.model_dump()["tools"] == CHAT_TOOLS


@pytest.mark.parametrize(
    "finish, expected",
    [("length", "incomplete"), ("stop", "completed"), ("tool_calls", "completed")],
)
def test_only_a_reply_cut_by_length_is_incomplete(finish, expected):
    status, details = response_status(finish)
    assert status == expected
    assert (details is not None) == (expected == "incomplete")
