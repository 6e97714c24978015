"""Early refusals arrive whole: a client still sending a large body reads the entire error.

A server that answers before it has read a request's body (401, 413, 408, 431) and then
closes its socket with the rest of the body unread makes the kernel reset the connection,
which can destroy the answer on its way. These tests send 10 MB at full speed from one
thread while another reads, several times over so that the race shows, against the real
server (uvicorn with vlite's protocol) in this process.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from dataclasses import dataclass

import pytest

from vlite.core.config import VliteConfig
from vlite.server import lingering_close
from vlite.server.settings import ServerSettings
from vlite.testing.server_thread import running_server
from vlite.testing.tiny_models import make_tiny_model

API_KEY = "linger-key"
AUTH = f"Authorization: Bearer {API_KEY}\r\n".encode()
TIMEOUT_S = 30
BODY_TIMEOUT_S = 2.0  # the 408 test waits for it
BIG_BODY = b"a" * 10_000_000  # over the 8 MiB default limit
REPEATS = 5


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = make_tiny_model(tmp_path_factory.mktemp("linger-model"), "LlamaForCausalLM")
    config = VliteConfig(model=str(model), dtype="float32", num_kv_blocks=8, cpu_threads=1)
    settings = ServerSettings(
        served_model_name="tiny", log_level="warning", api_key=(API_KEY,),
        body_timeout_s=BODY_TIMEOUT_S,
    )  # fmt: skip
    with running_server(config, settings, TIMEOUT_S) as api_server:
        yield api_server


@dataclass
class Reply:
    """A raw HTTP/1.1 response as read until the server closed the connection."""

    status: int
    headers: dict[str, str]
    body: bytes
    send_error: OSError | None = None
    recv_error: OSError | None = None

    def error(self) -> dict:
        """The OpenAI error object of the body (which must be whole to parse)."""
        assert len(self.body) == int(self.headers["content-length"]), self
        error = json.loads(self.body)["error"]
        assert set(error) == {"message", "type", "param", "code"}
        return error

    def anthropic_error(self) -> dict:
        """The Anthropic error object of the body (which must be whole to parse)."""
        assert len(self.body) == int(self.headers["content-length"]), self
        body = json.loads(self.body)
        assert body["type"] == "error" and set(body) == {"type", "error"}
        assert set(body["error"]) == {"type", "message"}
        return body["error"]


def parse(raw: bytes) -> Reply:
    if not raw:
        return Reply(0, {}, b"")
    head, _, body = raw.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return Reply(int(status_line.split()[1]), headers, body)


def exchange(server, head: bytes, body: bytes, *, pause_after: int = 0) -> Reply:
    """Send ``head`` and ``body`` at full speed from a thread (after ``pause_after``
    bytes of the body, wait for the server's answer before sending on) while this thread
    reads the reply until the server closes the connection."""
    answered = threading.Event()
    send_error: list[OSError] = []

    def send(conn: socket.socket) -> None:
        try:
            conn.sendall(head + body[:pause_after])
            if pause_after:
                answered.wait(TIMEOUT_S)
            conn.sendall(body[pause_after:])
        except OSError as exc:
            send_error.append(exc)

    with socket.create_connection(server.sock.getsockname()[:2], timeout=TIMEOUT_S) as conn:
        sender = threading.Thread(target=send, args=(conn,), daemon=True)
        sender.start()
        chunks = []
        recv_error = None
        try:
            while chunk := conn.recv(65536):
                chunks.append(chunk)
                answered.set()
        except ConnectionResetError as exc:
            recv_error = exc
        answered.set()
        sender.join(TIMEOUT_S)
    reply = parse(b"".join(chunks))
    reply.send_error = send_error[0] if send_error else None
    reply.recv_error = recv_error
    return reply


def post_head(
    *extra: bytes, length: int | None = len(BIG_BODY), path: bytes = b"/v1/completions"
) -> bytes:
    framing = (
        f"Content-Length: {length}\r\n" if length is not None else "Transfer-Encoding: chunked\r\n"
    )
    return (
        b"POST "
        + path
        + b" HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + b"".join(extra)
        + framing.encode()
        + b"\r\n"
    )


def chunked(body: bytes, size: int = 1 << 16) -> bytes:
    parts = [
        b"%x\r\n%s\r\n" % (len(body[i : i + size]), body[i : i + size])
        for i in range(0, len(body), size)
    ]
    return b"".join(parts) + b"0\r\n\r\n"


MANY_FIELDS = b"".join(b"X-Field-%d: v\r\n" % i for i in range(200))  # over 100 fields

REFUSALS = {
    "413-content-length": (post_head(AUTH), BIG_BODY, 413),
    "413-chunked": (post_head(AUTH, length=None), chunked(BIG_BODY), 413),
    "401-before-the-body": (post_head(), BIG_BODY, 401),
    "431-before-the-body": (post_head(AUTH, MANY_FIELDS), BIG_BODY, 431),
    "413-anthropic": (post_head(AUTH, path=b"/v1/messages"), BIG_BODY, 413),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_a_refusal_of_a_large_body_arrives_whole(server, case):
    head, body, status = REFUSALS[case]
    for attempt in range(REPEATS):
        reply = exchange(server, head, body)

        assert reply.recv_error is None, (attempt, reply)
        assert reply.status == status, (attempt, reply)
        if case == "413-anthropic":  # Anthropic's shape on its path
            error = reply.anthropic_error()
            assert error["type"] == "request_too_large"
            assert "larger than the limit" in error["message"]
        else:
            assert reply.error()["code"] == status
        assert reply.headers["connection"] == "close"
        # The server read and dropped the rest of the body: the client's send completed.
        assert reply.send_error is None, (attempt, reply.send_error)


def test_a_stalled_body_gets_its_whole_408_while_the_rest_follows(server):
    # 1 MB, then a pause past the body deadline, then the other 7 MB at full speed.
    body = BIG_BODY[:8_000_000]  # under the limit: the guard reads until the pause
    reply = exchange(server, post_head(AUTH, length=len(body)), body, pause_after=1_000_000)

    assert reply.recv_error is None, reply
    assert reply.status == 408, reply
    assert reply.error()["code"] == 408
    assert reply.headers["connection"] == "close"
    assert reply.send_error is None


def test_any_answer_before_the_body_has_arrived_ends_the_connection(server):
    # A route that does not exist answers 404 without 'Connection: close' and without
    # reading the body; the connection must not wait for that body to be reused.
    body = BIG_BODY[:8_000_000]
    head = post_head(AUTH, length=len(body), path=b"/v1/nowhere")
    start = time.monotonic()
    reply = exchange(server, head, body, pause_after=1_000_000)

    assert reply.recv_error is None, reply
    assert reply.status == 404, reply
    assert reply.error()["code"] == 404
    assert reply.send_error is None
    assert time.monotonic() - start < 3  # closed after the body, not kept alive


def test_a_small_request_keeps_its_connection(server):
    body = b'{"prompt": "Hi", "max_tokens": 1}'
    request = post_head(AUTH, length=len(body)) + body
    with socket.create_connection(server.sock.getsockname()[:2], timeout=TIMEOUT_S) as conn:
        for _ in range(2):  # the second request reuses the connection
            conn.sendall(request)
            raw = b""
            while b"\r\n\r\n" not in raw:
                raw += conn.recv(65536)
            reply = parse(raw)
            while len(reply.body) < int(reply.headers["content-length"]):
                reply.body += conn.recv(65536)
            assert reply.status == 200, reply
            assert reply.headers.get("connection") != "close"


def send_until_cut(server, pause_s: float) -> tuple[int, float]:
    """Send a 401's endless body in 64 KiB pieces, ``pause_s`` apart, until the server
    cuts the connection; return the bytes sent after the answer and the seconds taken."""
    head = post_head(length=10**12)  # no key, and a body that would take hours to send
    with socket.create_connection(server.sock.getsockname()[:2], timeout=TIMEOUT_S) as conn:
        conn.sendall(head)
        reply = b""
        while b"}" not in reply:
            reply += conn.recv(65536)
        assert parse(reply).status == 401
        start = time.monotonic()
        sent = 0
        with pytest.raises(OSError):  # the server stops reading: a reset or a broken pipe
            while time.monotonic() - start < TIMEOUT_S:
                conn.sendall(b"a" * 65536)
                sent += 65536
                time.sleep(pause_s)
        return sent, time.monotonic() - start


def test_a_client_that_never_stops_sending_is_cut_after_the_linger(server, monkeypatch):
    monkeypatch.setattr(lingering_close, "LINGER_TIMEOUT_S", 0.5)

    _, elapsed_s = send_until_cut(server, pause_s=0.01)  # about 6 MB/s, under the byte cap

    assert elapsed_s < 3


def test_a_client_sending_past_the_byte_cap_is_cut_before_the_linger_ends(server, monkeypatch):
    monkeypatch.setattr(lingering_close, "LINGER_MAX_BYTES", 1 << 20)

    sent, elapsed_s = send_until_cut(server, pause_s=0)

    # Cut soon after 1 MiB, long before the 5 s deadline; the kernel buffers the rest.
    assert elapsed_s < 3 and sent < 32 << 20
