"""The server's boundary: API keys, the context length, big bodies, slow clients."""

from __future__ import annotations

import socket
import threading
import time

import httpx
import pytest
from conftest import API_KEYS

from vlite.testing.server_process import ServerProcess

TIMEOUT_S = 30
CONTEXT = 128  # the shared server's --max-model-len


def url_of(server) -> tuple[str, int]:
    host, port = server.address.removeprefix("http://").split(":")
    return host, int(port)


def post(server, path: str, body: dict, headers: dict | None = None) -> httpx.Response:
    return httpx.post(server.address + path, json=body, headers=headers, timeout=TIMEOUT_S)


# ---- API keys -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"Authorization": "Bearer wrong-key"},
        {"Authorization": f"Bearer {API_KEYS[0]}x"},
        {"Authorization": f"Basic {API_KEYS[0]}"},
        {"Authorization": "Bearer"},
    ],
    ids=["none", "wrong", "longer", "not-bearer", "empty"],
)
def test_without_a_valid_key_every_api_route_is_401(server, headers):
    for method, path in (
        ("POST", "/v1/completions"),
        ("POST", "/v1/chat/completions"),
        ("POST", "/tokenize"),
        ("POST", "/detokenize"),
        ("GET", "/v1/models"),
        ("GET", "/docs"),
        ("GET", "/openapi.json"),
    ):
        response = httpx.request(
            method, server.address + path, json={"prompt": "x"}, headers=headers
        )
        assert response.status_code == 401, (path, response.text)
        assert response.json()["error"]["type"] == "AuthenticationError"
        assert response.headers["www-authenticate"] == "Bearer"


def test_each_configured_key_works_and_health_and_metrics_stay_open(server):
    body = {"prompt": "Hello", "max_tokens": 2}
    for key in API_KEYS:
        response = post(server, "/v1/completions", body, {"Authorization": f"Bearer {key}"})
        assert response.status_code == 200, response.text
        response = post(server, "/tokenize", body, {"Authorization": f"Bearer {key}"})
        assert response.status_code == 200, response.text
    assert httpx.get(server.address + "/health").status_code == 200
    assert httpx.get(server.address + "/metrics").status_code == 200


# ---- the context length ---------------------------------------------------------------


def test_prompt_plus_max_tokens_at_the_context_runs_and_one_more_is_a_400(server, auth):
    prompt = list(range(10, 110))  # 100 tokens
    fits = post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 28}, auth)
    assert fits.status_code == 200, fits.text
    over = post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 29}, auth)
    assert over.status_code == 400
    message = over.json()["error"]["message"]
    assert "128" in message and "100" in message and "29" in message


def test_a_prompt_filling_the_context_is_a_400_not_a_truncated_answer(server, auth):
    response = post(server, "/v1/completions", {"prompt": list(range(10, 138))}, auth)
    assert response.status_code == 400
    assert "maximum context length is 128" in response.json()["error"]["message"]


def test_samples_that_fill_the_cache_together_still_run(server, auth):
    # 64 blocks of 16 = 1,024 slots: 8 samples of up to 128 tokens fill it; each fits alone.
    body = {"prompt": list(range(10, 100)), "max_tokens": 38, "n": 8, "ignore_eos": True}
    response = post(server, "/v1/completions", body, auth)
    assert response.status_code == 200, response.text
    assert [len(c["text"]) > 0 for c in response.json()["choices"]] == [True] * 8


def test_a_request_that_could_never_fit_the_kv_cache_is_refused_at_once(tiny_model):
    server = ServerProcess(tiny_model, "--num-kv-blocks", "4", "--cpu-threads", "1")
    try:
        body = {"prompt": "Hello", "max_tokens": 100}  # needs 7 blocks of 16; there are 4
        response = post(server, "/v1/completions", body)
        assert response.status_code == 400
        assert "KV-cache blocks" in response.json()["error"]["message"]
        fits = post(server, "/v1/completions", {"prompt": "Hello", "max_tokens": 20})
        assert fits.status_code == 200
    finally:
        server.kill()


# ---- big bodies -----------------------------------------------------------------------


def test_a_body_announced_larger_than_the_limit_is_413_before_it_is_sent(server, auth):
    host, port = url_of(server)
    with socket.create_connection((host, port), timeout=TIMEOUT_S) as conn:
        conn.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Authorization: {auth['Authorization']}\r\n".encode()
            + b"Content-Length: 10000000000\r\n\r\n"
        )
        reply = conn.recv(4096)
    assert reply.startswith(b"HTTP/1.1 413"), reply[:200]


def test_a_body_larger_than_the_limit_is_413(server, auth):
    body = b'{"prompt": "' + b"a" * (9 << 20) + b'"}'  # 9 MiB, over the 8 MiB default
    headers = {**auth, "Content-Type": "application/json"}
    response = httpx.post(
        server.address + "/v1/completions", content=body, headers=headers, timeout=TIMEOUT_S
    )
    assert response.status_code == 413


def test_a_chunked_body_growing_past_the_limit_is_413(server, auth):
    def chunks():
        yield b'{"prompt": "'
        for _ in range(9):
            yield b"a" * (1 << 20)
        yield b'"}'

    headers = {**auth, "Content-Type": "application/json"}
    response = httpx.post(
        server.address + "/v1/completions", content=chunks(), headers=headers, timeout=TIMEOUT_S
    )
    assert response.status_code == 413


def test_a_long_prompt_is_refused_untokenized_while_health_answers(server, auth):
    health: list[int] = []
    done = threading.Event()

    def poll_health():
        while not done.is_set():
            health.append(httpx.get(server.address + "/health", timeout=TIMEOUT_S).status_code)
            time.sleep(0.01)

    poller = threading.Thread(target=poll_health)
    poller.start()
    try:
        prompt = "lorem ipsum " * 500_000  # 6 MB of text
        response = post(server, "/v1/completions", {"prompt": prompt}, auth)
    finally:
        done.set()
        poller.join(TIMEOUT_S)
    assert response.status_code == 400
    assert "characters" in response.json()["error"]["message"]
    assert health and set(health) == {200}


def test_too_many_header_fields_is_431(server, auth):
    headers = {**auth, **{f"X-Field-{i}": "v" for i in range(200)}}
    response = httpx.get(server.address + "/v1/models", headers=headers, timeout=TIMEOUT_S)
    assert response.status_code == 431


def test_a_huge_header_block_is_refused(server):
    headers = {f"X-Field-{i}": "v" * 1000 for i in range(90)}  # 90 KB, over 64 KiB
    response = httpx.get(server.address + "/health", headers=headers, timeout=TIMEOUT_S)
    assert response.status_code in (400, 431)


# ---- slow clients ---------------------------------------------------------------------


def closed_by_server(conn: socket.socket, within_s: float) -> bool:
    """Whether the server closes ``conn`` within ``within_s`` (reading what it sends)."""
    conn.settimeout(within_s)
    try:
        while conn.recv(4096):
            pass
    except TimeoutError:
        return False
    except ConnectionResetError:
        pass
    return True


def test_a_client_that_never_finishes_its_headers_is_cut(server):
    with socket.create_connection(url_of(server), timeout=TIMEOUT_S) as conn:
        conn.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # and no more
        assert closed_by_server(conn, within_s=10), "the half-sent request was held open"


def test_a_connection_that_sends_nothing_is_cut(server):
    with socket.create_connection(url_of(server), timeout=TIMEOUT_S) as conn:
        assert closed_by_server(conn, within_s=10)


def test_a_client_that_stalls_in_its_body_gets_408(server, auth):
    with socket.create_connection(url_of(server), timeout=TIMEOUT_S) as conn:
        conn.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Authorization: {auth['Authorization']}\r\n".encode()
            + b'Content-Length: 100\r\n\r\n{"prompt": '
        )
        conn.settimeout(10)
        reply = conn.recv(4096)
    assert reply.startswith(b"HTTP/1.1 408"), reply[:200]


def test_many_half_sent_requests_are_all_cut_and_the_server_still_answers(server, auth):
    conns = [socket.create_connection(url_of(server), timeout=TIMEOUT_S) for _ in range(50)]
    try:
        for conn in conns:
            conn.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        deadline = time.monotonic() + 15
        assert all(closed_by_server(c, max(0.1, deadline - time.monotonic())) for c in conns)
    finally:
        for conn in conns:
            conn.close()
    response = post(server, "/v1/completions", {"prompt": "Hello", "max_tokens": 2}, auth)
    assert response.status_code == 200
