"""``/tokenize`` and ``/detokenize`` on a real server (a tiny model's, in a thread): the ids
are the tokenizer's and the chat template's, as the completion endpoints compute them."""

from __future__ import annotations

import httpx
import pytest

from vlite.core.config import VliteConfig
from vlite.server.settings import ServerSettings
from vlite.testing.server_thread import running_server
from vlite.testing.tiny_models import make_tiny_model

MODEL_NAME = "tiny-llama"
TIMEOUT_S = 60
TEXT = "The quick brown fox jumps over the lazy dog."
CHAT = [{"role": "user", "content": "Tell me a joke."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = make_tiny_model(tmp_path_factory.mktemp("tokenize-model"), "LlamaForCausalLM")
    config = VliteConfig(model=str(model), dtype="float32", num_kv_blocks=8, cpu_threads=1)
    settings = ServerSettings(served_model_name=MODEL_NAME, log_level="warning")
    with running_server(config, settings, TIMEOUT_S) as api_server:
        yield api_server


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.address, timeout=TIMEOUT_S) as client:
        yield client


@pytest.fixture(scope="module")
def tokenizer(server):
    return server.engine.get_tokenizer()


def tokenize(client, **body) -> dict:
    response = client.post("/tokenize", json={"model": MODEL_NAME, **body})
    assert response.status_code == 200, response.text
    return response.json()


def template_ids(tokenizer, messages, **options) -> list[int]:
    """The ids ``transformers`` gives the conversation: its template's text, tokenized as is."""
    options.setdefault("add_generation_prompt", True)
    text = tokenizer.apply_chat_template(messages, tokenize=False, **options)
    return tokenizer.encode(text, add_special_tokens=False)


def test_a_text_gets_the_ids_a_completion_generates_from(client, tokenizer):
    answer = tokenize(client, prompt=TEXT)

    ids = tokenizer.encode(TEXT)
    assert ids[0] == tokenizer.bos_token_id
    assert answer == {"count": len(ids), "max_model_len": 512, "tokens": ids, "token_strs": None}
    completion = client.post(
        "/v1/completions", json={"model": MODEL_NAME, "prompt": TEXT, "max_tokens": 1}
    ).json()
    assert completion["usage"]["prompt_tokens"] == answer["count"]


def test_a_text_without_special_tokens_has_no_bos(client, tokenizer):
    answer = tokenize(client, prompt=TEXT, add_special_tokens=False)

    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    assert answer["tokens"] == ids and answer["count"] == len(ids)
    assert answer["tokens"] == tokenize(client, prompt=TEXT)["tokens"][1:]


def test_token_strs_are_the_tokenizers_pieces(client, tokenizer):
    answer = tokenize(client, prompt=TEXT, return_token_strs=True)

    assert answer["token_strs"] == tokenizer.convert_ids_to_tokens(answer["tokens"])
    assert answer["token_strs"][0] == "<s>" and len(answer["token_strs"]) == answer["count"]


def test_messages_get_the_ids_a_chat_completion_generates_from(client, tokenizer):
    answer = tokenize(client, messages=CHAT)

    assert answer["tokens"] == template_ids(tokenizer, CHAT)
    assert answer["tokens"][0] != tokenizer.bos_token_id  # the template has none
    chat = client.post(
        "/v1/chat/completions", json={"model": MODEL_NAME, "messages": CHAT, "max_tokens": 1}
    ).json()
    assert chat["usage"]["prompt_tokens"] == answer["count"]


def test_messages_as_content_parts_are_joined_as_chat_joins_them(client):
    parts = [{"type": "text", "text": "Tell me "}, {"type": "text", "text": "a joke."}]
    by_parts = tokenize(client, messages=[{"role": "user", "content": parts}])
    assert by_parts["tokens"] == tokenize(client, messages=CHAT)["tokens"]


@pytest.mark.parametrize(
    ("options", "template_options"),
    [
        ({"add_generation_prompt": False}, {"add_generation_prompt": False}),
        (
            {"continue_final_message": True},
            {"add_generation_prompt": False, "continue_final_message": True},
        ),
    ],
    ids=["no-generation-prompt", "continue-final-message"],
)
def test_template_options_change_the_ids_as_transformers_does(
    client, tokenizer, options, template_options
):
    messages = [*CHAT, {"role": "assistant", "content": "Why did the"}]

    answer = tokenize(client, messages=messages, **options)

    assert answer["tokens"] == template_ids(tokenizer, messages, **template_options)
    assert answer["tokens"] != tokenize(client, messages=messages)["tokens"]


def test_messages_with_special_tokens_get_a_bos_before_the_template(client, tokenizer):
    answer = tokenize(client, messages=CHAT, add_special_tokens=True)

    assert answer["tokens"] == [tokenizer.bos_token_id, *template_ids(tokenizer, CHAT)]


@pytest.mark.parametrize("add_special_tokens", [False, True])
def test_detokenize_gives_back_the_tokenized_text(client, add_special_tokens):
    ids = tokenize(client, prompt=TEXT, add_special_tokens=add_special_tokens)["tokens"]

    response = client.post("/detokenize", json={"model": MODEL_NAME, "tokens": ids})

    assert response.status_code == 200, response.text
    assert response.json() == {"prompt": ("<s>" if add_special_tokens else "") + TEXT}


@pytest.mark.parametrize(
    ("path", "body", "status", "param", "message"),
    [
        ("/detokenize", {"tokens": [5, 320]}, 400, "tokens", "token 1 is 320, outside"),
        ("/detokenize", {"tokens": [-1]}, 400, "tokens", "[0, 320)"),
        ("/detokenize", {}, 400, "tokens", "required"),
        ("/detokenize", {"tokens": [2**40]}, 400, "tokens.0", "less than"),
        ("/detokenize", {"model": "gpt-5", "tokens": [5]}, 404, "model", "does not exist"),
        ("/tokenize", {"model": "gpt-5", "prompt": "x"}, 404, "model", "does not exist"),
        ("/tokenize", {}, 400, "prompt", "prompt (a text) or messages"),
        ("/tokenize", {"prompt": "x", "messages": CHAT}, 400, "messages", "send one of them"),
        ("/tokenize", {"messages": []}, 400, "messages", "at least one"),
        ("/tokenize", {"prompt": 5}, 400, "prompt", "valid string"),
        ("/tokenize", {"prompt": "x", "tools": []}, 400, "tools", "applies to messages"),
        (
            "/tokenize",
            {"prompt": "x", "add_generation_prompt": False},
            400,
            "add_generation_prompt",
            "applies to messages",
        ),
        (
            "/tokenize",
            {"messages": CHAT, "continue_final_message": True, "add_generation_prompt": True},
            400,
            "continue_final_message",
            "cannot go with add_generation_prompt",
        ),
        ("/tokenize", {"prompt": "x" * 100_000}, 400, "prompt", "characters"),
        (
            "/tokenize",
            {"messages": [{"role": "user", "content": "x" * 100_000}]},
            400,
            "messages",
            "characters",
        ),
        (
            "/tokenize",
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            400,
            "messages.0.content",
            "non-text part",
        ),
    ],
)
def test_bad_requests_get_an_openai_error_naming_the_field(
    client, path, body, status, param, message
):
    response = client.post(path, json=body)

    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param
    assert message in error["message"], error["message"]
    assert error["code"] == status
    assert error["type"] == ("NotFoundError" if status == 404 else "BadRequestError")
