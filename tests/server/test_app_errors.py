"""Engine failures as the HTTP client sees them, with a fake engine (no model, no process)."""

from __future__ import annotations

import asyncio
import json
import logging
import re

import httpx

from vlite.core.errors import InvalidRequestError
from vlite.core.outputs import CompletionOutput, RequestOutput
from vlite.engine.exceptions import EngineDeadError, EngineGenerateError
from vlite.server.api_server import build_app
from vlite.server.guards import Drain


class FakeTokenizer:
    def get_vocab(self) -> dict[str, int]:
        return {"a": 0, "bb": 1}


class FakeEngineBase:
    """What the server asks of an engine before it generates."""

    max_model_len = 64

    def get_tokenizer(self) -> FakeTokenizer:
        return FakeTokenizer()

    async def tokenize(self, prompt):
        return {"prompt": prompt, "prompt_token_ids": [1]}

    def add_finished_request_observer(self, observer) -> None:
        pass


class FailingEngine(FakeEngineBase):
    """Streams one token of text, then fails; or, once dead, fails at once."""

    def __init__(self, dead: bool) -> None:
        self.dead_error = EngineDeadError("the engine core process died: test") if dead else None

    async def generate(self, prompt, params, request_id, output_kind):
        if self.dead_error is not None:
            raise self.dead_error
        yield RequestOutput(request_id, "p", [1, 2], [CompletionOutput(0, "Hi", [7])], False)
        raise EngineGenerateError("the engine core's step failed: RuntimeError: boom")


def request(engine, method: str, path: str, **kwargs) -> httpx.Response:
    async def send():
        transport = httpx.ASGITransport(app=build_app(engine, "fake"))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await client.request(method, path, **kwargs)

    return asyncio.run(asyncio.wait_for(send(), 30))


def test_a_dead_engine_fails_health_and_requests_with_503():
    engine = FailingEngine(dead=True)

    health = request(engine, "GET", "/health")
    completion = request(engine, "POST", "/v1/completions", json={"prompt": "x"})

    assert health.status_code == 503
    assert "died" in health.json()["error"]["message"]
    assert completion.status_code == 503
    assert completion.json()["error"]["type"] == "InternalServerError"


def test_a_failure_mid_stream_ends_the_stream_with_an_error_event():
    body = {"prompt": "x", "stream": True}

    response = request(FailingEngine(dead=False), "POST", "/v1/completions", json=body)

    events = [line for line in response.text.split("\n\n") if line]
    assert response.status_code == 200
    assert json.loads(events[0].removeprefix("data: "))["choices"][0]["text"] == "Hi"
    error = json.loads(events[1].removeprefix("data: "))["error"]
    assert "boom" in error["message"] and error["code"] == 500
    assert events[-1] == "data: [DONE]"


def test_a_failure_without_streaming_is_a_500():
    response = request(FailingEngine(dead=False), "POST", "/v1/completions", json={"prompt": "x"})

    assert response.status_code == 500
    assert "boom" in response.json()["error"]["message"]


class RaisingEngine(FakeEngineBase):
    """Raises ``error`` when asked to generate."""

    def __init__(self, error: Exception) -> None:
        self.error = error
        self.dead_error = None

    async def generate(self, prompt, params, request_id, output_kind):
        raise self.error
        yield  # an async generator


def test_an_invalid_request_is_a_400_naming_what_is_wrong():
    engine = RaisingEngine(InvalidRequestError("prompt of 99 tokens exceeds max_model_len=64"))

    response = request(engine, "POST", "/v1/completions", json={"prompt": "x"})

    assert response.status_code == 400
    assert "max_model_len=64" in response.json()["error"]["message"]


def test_a_bug_is_a_500_with_an_id_and_a_logged_traceback_never_a_400(caplog):
    # A plain ValueError from inside the server is a bug, not the client's bad input.
    engine = RaisingEngine(ValueError("list.remove(x): x not in list"))

    with caplog.at_level(logging.ERROR, logger="vlite.server.errors"):
        response = request(engine, "POST", "/v1/completions", json={"prompt": "x"})

    assert response.status_code == 500
    message = response.json()["error"]["message"]
    assert "list.remove" not in message  # internals stay in the server's log
    error_id = re.search(r"id ([0-9a-f]{12})", message).group(1)
    logged = [r for r in caplog.records if error_id in r.getMessage()]
    assert logged and logged[0].exc_info is not None


def test_refusals_on_anthropics_path_take_its_shape_and_keep_their_headers():
    async def send():
        drain = Drain()
        transport = httpx.ASGITransport(
            app=build_app(FailingEngine(dead=False), "fake", None, drain)
        )
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            replies = [
                await client.get("/v1/messages"),  # routing's 405
                await client.post("/v1/messages/count_tokens", json={}),  # routing's 404
            ]
            drain.draining = True
            replies += [
                await client.post(path, json={}) for path in ("/v1/messages", "/v1/completions")
            ]
            return replies

    wrong_method, missing, draining, openai = asyncio.run(asyncio.wait_for(send(), 30))

    for reply, status, kind in (
        (wrong_method, 405, "invalid_request_error"),
        (missing, 404, "not_found_error"),
        (draining, 503, "overloaded_error"),
    ):
        assert reply.status_code == status
        body = reply.json()
        assert body == {
            "type": "error",
            "error": {"type": kind, "message": body["error"]["message"]},
        }
    assert wrong_method.headers["allow"] == "POST"
    assert draining.headers["retry-after"] == "5" and draining.headers["connection"] == "close"
    assert "shutting down" in draining.json()["error"]["message"]
    # Elsewhere, OpenAI's shape, same message and headers.
    assert openai.status_code == 503 and openai.headers["retry-after"] == "5"
    assert openai.json()["error"]["message"] == draining.json()["error"]["message"]
    assert openai.json()["error"]["type"] == "InternalServerError"
