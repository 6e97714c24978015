"""Malformed requests of many kinds: each is a 4xx in OpenAI's error shape with a short
body, never a 5xx or a hang, and the server serves the next good request as before."""

from __future__ import annotations

import httpx
import pytest

TIMEOUT_S = 30
COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "Hi"}]
HUGE = 2**64
BIG_TEXT = "word " * 40_000  # 200,000 characters

#: (name, path, body: a dict sent as JSON, or raw bytes).
MALFORMED = [
    ("invalid JSON", COMPLETIONS, b'{"prompt": "x",'),
    ("JSON that is not an object", COMPLETIONS, b"[1, 2, 3]"),
    ("NaN temperature", COMPLETIONS, b'{"prompt": "x", "temperature": NaN}'),
    ("infinite top_p", COMPLETIONS, b'{"prompt": "x", "top_p": Infinity}'),
    ("missing prompt", COMPLETIONS, {"max_tokens": 2}),
    ("prompt of the wrong type", COMPLETIONS, {"prompt": {"text": "x"}}),
    ("seed beyond 64 bits", COMPLETIONS, {"prompt": "x", "seed": HUGE}),
    ("max_tokens beyond 64 bits", COMPLETIONS, {"prompt": "x", "max_tokens": HUGE}),
    ("stop token id beyond 64 bits", COMPLETIONS, {"prompt": "x", "stop_token_ids": [HUGE]}),
    ("n beyond 64 bits", COMPLETIONS, {"prompt": "x", "n": HUGE}),
    ("n over the server's limit", COMPLETIONS, {"prompt": "x", "n": 9}),
    ("max_tokens of a trillion", COMPLETIONS, {"prompt": "x", "max_tokens": 10**12}),
    ("max_tokens past the context", COMPLETIONS, {"prompt": "x", "max_tokens": 128}),
    ("negative max_tokens", COMPLETIONS, {"prompt": "x", "max_tokens": -1}),
    ("token id outside the vocabulary", COMPLETIONS, {"prompt": [1, 2, 10**9]}),
    ("negative token id", COMPLETIONS, {"prompt": [1, -2]}),
    ("a batch of prompts", COMPLETIONS, {"prompt": ["a", "b"]}),
    ("an empty token list", COMPLETIONS, {"prompt": []}),
    ("a prompt longer than the context", COMPLETIONS, {"prompt": BIG_TEXT}),
    ("too many stop strings", COMPLETIONS, {"prompt": "x", "stop": ["a"] * 65}),
    ("a stop string too long", COMPLETIONS, {"prompt": "x", "stop": ["s" * 513]}),
    ("logprobs over 20", COMPLETIONS, {"prompt": "x", "logprobs": 21}),
    ("an unsupported feature", COMPLETIONS, {"prompt": "x", "best_of": 4}),
    ("another model", COMPLETIONS, {"prompt": "x", "model": "m" * 5000}),
    ("no messages", CHAT, {"messages": []}),
    ("a message that is not an object", CHAT, {"messages": ["hello"]}),
    (
        "a non-text content part",
        CHAT,
        {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
    ),  # noqa: E501
    ("top_logprobs without logprobs", CHAT, {"messages": MESSAGES, "top_logprobs": 2}),
    ("a temperature of the wrong type", CHAT, {"messages": MESSAGES, "temperature": "hot"}),
    ("an echo of huge input", CHAT, {"messages": MESSAGES, "temperature": ["x" * 100_000]}),
]


@pytest.fixture(scope="module")
def client(server, auth):
    with httpx.Client(base_url=server.address, headers=auth, timeout=TIMEOUT_S) as client:
        yield client


def send(client: httpx.Client, path: str, body) -> httpx.Response:
    if isinstance(body, bytes):
        return client.post(path, content=body, headers={"Content-Type": "application/json"})
    return client.post(path, json=body)


def good_tokens(client: httpx.Client) -> list:
    body = {"prompt": "Once upon a time", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    response = client.post(COMPLETIONS, json={**body, "logprobs": 0})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["logprobs"]["tokens"]


def test_there_are_at_least_twenty_kinds():
    assert len({name for name, _, _ in MALFORMED}) >= 20


@pytest.mark.parametrize(("name", "path", "body"), MALFORMED, ids=[m[0] for m in MALFORMED])
def test_a_malformed_request_is_a_short_4xx(client, name, path, body):
    for stream in (False, True):
        if isinstance(body, dict):
            body = {**body, "stream": stream}
        response = send(client, path, body)

        assert 400 <= response.status_code < 500, (name, response.status_code, response.text)
        assert len(response.content) <= 2048, (name, len(response.content))
        error = response.json()["error"]
        assert error["message"] and error["code"] == response.status_code


def test_good_requests_interleaved_with_bad_ones_get_the_answers_they_get_alone(client):
    alone = good_tokens(client)
    for _, path, body in MALFORMED:
        assert send(client, path, body).status_code < 500
        assert good_tokens(client) == alone
    healthy = [
        line
        for line in client.get("/metrics").text.splitlines()
        if line.startswith("vlite:engine_healthy{")
    ]
    assert len(healthy) == 1 and healthy[0].endswith(" 1.0"), healthy
