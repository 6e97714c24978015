"""Stopping and dying: SIGTERM drains, a second signal stops at once, a dead engine core
stops the server (exit status 1), a killed front end takes its core with it; none leaves a
process or an IPC file behind. Each test starts its own server."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from vlite.testing.server_process import ServerProcess, pid_is_alive

TIMEOUT_S = 60
LONG = {"prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True, "stream": True}


class Stream:
    """A streaming completion read on a thread: its events, and how it ended."""

    def __init__(self, address: str, body: dict) -> None:
        self.status: int | None = None
        self.events: list[str] = []
        self.first_event = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._read, args=(address, body), daemon=True)
        self.thread.start()

    def _read(self, address: str, body: dict) -> None:
        try:
            with httpx.stream(
                "POST", address + "/v1/completions", json=body, timeout=TIMEOUT_S
            ) as response:
                self.status = response.status_code
                for line in response.iter_lines():
                    if line:
                        self.events.append(line.removeprefix("data: "))
                        self.first_event.set()
        except BaseException as exc:
            self.error = exc
        finally:
            self.first_event.set()

    def join(self) -> None:
        self.thread.join(TIMEOUT_S)
        assert not self.thread.is_alive(), "the stream hung"

    @property
    def refused(self) -> bool:
        """Answered with an error status before any output (it never started streaming)."""
        return self.status is not None and self.status >= 400 and "error" in self.events[0]

    @property
    def ended_cleanly(self) -> bool:
        """Finished normally or with an error event, and then ``[DONE]``."""
        if self.error is not None or not self.events or self.events[-1] != "[DONE]":
            return False
        last = json.loads(self.events[-2])
        return "error" in last or last["choices"][0]["finish_reason"] is not None

    @property
    def got_error_event(self) -> bool:
        return any('"error"' in event for event in self.events[:-1])


def start_streams(server: ServerProcess, count: int, body: dict = LONG) -> list[Stream]:
    streams = [Stream(server.address, body) for _ in range(count)]
    for stream in streams:
        assert stream.first_event.wait(TIMEOUT_S) and stream.events, stream.error
    return streams


def assert_nothing_left(server: ServerProcess) -> None:
    deadline = time.monotonic() + 15
    while pid_is_alive(server.core_pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not pid_is_alive(server.core_pid), "the engine core outlived the server"
    assert server.ipc_dir is not None and not server.ipc_dir.exists(), "IPC files left"


@pytest.fixture
def start_server(slow_model):
    started: list[ServerProcess] = []

    def start(*args: str) -> ServerProcess:
        server = ServerProcess(slow_model, "--cpu-threads", "1", *args)
        started.append(server)
        return server

    yield start
    for server in started:
        server.kill()


def queued_streams(server: ServerProcess, count: int, body: dict = LONG) -> list[Stream]:
    """``count`` streams on a server that runs one request at a time: the first is
    running (it sent an event), the others wait their turn."""
    streams = [Stream(server.address, body) for _ in range(count)]
    assert streams[0].first_event.wait(TIMEOUT_S) and streams[0].events, streams[0].error
    time.sleep(0.2)  # the others reach the engine
    return streams


def test_sigterm_refuses_new_requests_and_lets_running_ones_finish(start_server):
    server = start_server("--max-num-seqs", "1", "--shutdown-timeout-s", "600")
    streams = queued_streams(server, 3, {**LONG, "max_tokens": 60})
    server.signal(signal.SIGTERM)
    time.sleep(0.2)
    refused = httpx.post(server.address + "/v1/completions", json=LONG, timeout=TIMEOUT_S)
    assert refused.status_code == 503
    assert refused.headers["retry-after"].isdigit()
    assert httpx.get(server.address + "/health").status_code == 503

    for stream in streams:
        stream.join()
        assert stream.ended_cleanly and not stream.got_error_event, stream.events[-3:]
        assert json.loads(stream.events[-2])["choices"][0]["finish_reason"] == "length"
    assert server.wait(TIMEOUT_S) == 0, server.log_text
    assert_nothing_left(server)


def test_after_the_shutdown_timeout_each_stream_ends_with_an_error_event(start_server):
    server = start_server("--max-num-seqs", "1", "--shutdown-timeout-s", "0.5")
    streams = queued_streams(server, 3)
    server.signal(signal.SIGTERM)
    for stream in streams:
        stream.join()
        # Finished before the signal, or streaming: an error event, then [DONE]. Still
        # waiting for its first token (the response not started): a 503.
        assert stream.ended_cleanly or (stream.refused and stream.status == 503), stream.events[-3:]
    assert any(stream.got_error_event for stream in streams), "no stream was cut"
    assert server.wait(TIMEOUT_S) == 0, server.log_text
    assert_nothing_left(server)


def test_a_second_signal_stops_at_once(start_server):
    server = start_server("--shutdown-timeout-s", "600")
    streams = start_streams(server, 2)
    server.signal(signal.SIGTERM)
    time.sleep(0.3)
    server.signal(signal.SIGINT)
    assert server.wait(30) == 0, server.log_text
    for stream in streams:
        stream.join()
        assert stream.error is not None or stream.ended_cleanly
    assert_nothing_left(server)


def test_a_dead_engine_core_fails_requests_and_stops_the_server_with_status_1(start_server):
    server = start_server()
    streams = start_streams(server, 2)
    killed_at = time.monotonic()
    os.kill(server.core_pid, signal.SIGKILL)
    for stream in streams:
        stream.join()
        assert stream.got_error_event or stream.error is not None
    failed_within_s = time.monotonic() - killed_at
    assert server.wait(TIMEOUT_S) == 1, server.log_text
    assert "engine core died" in server.log_text
    assert failed_within_s < 30
    assert_nothing_left(server)


def child_pids(pid: int) -> list[int]:
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return [int(child) for child in children]


def test_a_killed_worker_stops_the_engine_and_the_server_with_status_1(start_server):
    server = start_server("--executor", "multiproc", "--tp", "2")
    workers = child_pids(server.core_pid)
    assert len(workers) >= 2, workers
    streams = start_streams(server, 2)
    os.kill(workers[-1], signal.SIGKILL)
    for stream in streams:
        stream.join()
        assert stream.got_error_event or stream.error is not None
    assert server.wait(TIMEOUT_S) == 1, server.log_text
    assert_nothing_left(server)
    deadline = time.monotonic() + 10
    while any(pid_is_alive(w) for w in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(pid_is_alive(worker) for worker in workers), "a worker outlived the core"


def test_a_killed_front_end_takes_its_engine_core_and_ipc_files_with_it(start_server):
    server = start_server()
    start_streams(server, 1)
    os.kill(server.process.pid, signal.SIGKILL)
    server.wait(TIMEOUT_S)
    assert_nothing_left(server)


def test_clients_that_disconnect_mid_stream_leave_the_engine_idle(start_server):
    server = start_server()
    with httpx.Client(base_url=server.address, timeout=TIMEOUT_S) as client:
        for index in range(10):
            with client.stream("POST", "/v1/completions", json={**LONG, "n": 1 + index % 2}) as r:
                next(line for line in r.iter_lines() if line.startswith("data: {"))
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            scrape = client.get("/metrics").text
            if _gauge(scrape, "num_requests_running") == 0:
                break
            time.sleep(0.05)
        assert _gauge(scrape, "num_requests_running") == 0
        assert _gauge(scrape, "num_requests_waiting") == 0
        assert _gauge(scrape, "kv_cache_usage_perc") == 0
        ok = client.post("/v1/completions", json={**LONG, "stream": False, "max_tokens": 3})
        assert ok.status_code == 200


def _gauge(scrape: str, name: str) -> float:
    for line in scrape.splitlines():
        if line.startswith(f"vlite:{name}{{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no vlite:{name} in /metrics")
