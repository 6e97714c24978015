"""Engine failures as the HTTP client sees them, with a fake engine (no model, no process)."""

from __future__ import annotations

import asyncio
import json

import httpx

from vlite.core.outputs import CompletionOutput, RequestOutput
from vlite.engine.exceptions import EngineDeadError, EngineGenerateError
from vlite.server.api_server import build_app


class FailingEngine:
    """Streams one token of text, then fails; or, once dead, fails at once."""

    max_model_len = 64

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
