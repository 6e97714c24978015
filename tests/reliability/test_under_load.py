"""Answers that must not change with load: greedy tokens beside other requests, seeded
samples, and clients that give up leave nothing behind."""

from __future__ import annotations

import concurrent.futures
import contextlib
import time

import httpx

TIMEOUT_S = 60


def tokens(server, auth, body: dict) -> list[str]:
    response = httpx.post(
        server.address + "/v1/completions",
        json={"max_tokens": 12, "ignore_eos": True, "logprobs": 0, **body},
        headers=auth,
        timeout=TIMEOUT_S,
    )
    assert response.status_code == 200, response.text
    return [choice["logprobs"]["tokens"] for choice in response.json()["choices"]]


def concurrently(calls: list) -> list:
    with concurrent.futures.ThreadPoolExecutor(len(calls)) as pool:
        return [future.result() for future in [pool.submit(call) for call in calls]]


def gauges(server) -> dict[str, float]:
    values = {}
    for line in httpx.get(server.address + "/metrics", timeout=TIMEOUT_S).text.splitlines():
        if line.startswith("vlite:") and 'le="' not in line and "{" in line:
            values[line.split("{", 1)[0]] = float(line.rsplit(" ", 1)[1])
    return values


def wait_idle(server, timeout_s: float = 10.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout_s
    while True:
        values = gauges(server)
        if values["vlite:num_requests_running"] == 0 or time.monotonic() > deadline:
            return values
        time.sleep(0.05)


def test_greedy_answers_do_not_depend_on_what_else_runs(server, auth):
    prompts = ["The quick brown fox", "Once upon a time", "In the beginning", "Hello there"]
    alone = [tokens(server, auth, {"prompt": p, "temperature": 0}) for p in prompts]
    together = concurrently(
        [lambda p=p: tokens(server, auth, {"prompt": p, "temperature": 0}) for p in prompts * 3]
    )
    assert together == alone * 3


def test_seeded_samples_repeat_under_load(server, auth):
    body = {"prompt": "Once upon a time", "temperature": 1.0, "seed": 1234, "n": 2}
    alone = tokens(server, auth, body)
    noise = {"prompt": "Noise", "temperature": 1.0, "max_tokens": 30}
    results = concurrently(
        [lambda: tokens(server, auth, body)] * 4 + [lambda: tokens(server, auth, noise)] * 4
    )
    assert results[:4] == [alone] * 4
    assert alone[0] != alone[1]  # the two samples differ (seed + index)


def test_clients_that_time_out_leave_the_engine_idle(server, auth):
    body = {"prompt": "Once upon a time", "max_tokens": 100, "ignore_eos": True}
    for _ in range(10):
        with contextlib.suppress(httpx.TimeoutException):
            httpx.post(server.address + "/v1/completions", json=body, headers=auth, timeout=0.02)
    idle = wait_idle(server)
    assert idle["vlite:num_requests_running"] == 0
    assert idle["vlite:num_requests_waiting"] == 0
    assert idle["vlite:kv_cache_usage_perc"] == 0
