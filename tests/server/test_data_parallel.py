"""``vlite serve --data-parallel-size 2`` on the default model: two engine-core processes
behind one API server. One shared server answers the request, metrics and abort tests;
the test that kills a core starts its own."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from click.testing import CliRunner

import vlite.server.api_server as api_server
from vlite.cli.main import cli
from vlite.core.config import VliteConfig
from vlite.core.sampling_params import SamplingParams
from vlite.core.stats import StepTotals
from vlite.engine.core_messages import EngineCoreStats
from vlite.engine.llm import LLM
from vlite.server.metrics import render_metrics
from vlite.testing.server_process import ServerProcess, pid_is_alive

TIMEOUT_S = 60
SERVER_ARGS = (
    "--data-parallel-size", "2",
    "--cpu-threads", "1",  # one thread per core on this two-core machine
    "--max-model-len", "512",
    "--num-kv-blocks", "64",
)  # fmt: skip
PROMPTS = [
    "The capital of France is",
    "Water boils at",
    "My favourite colour is",
    "The quick brown fox",
    "Once upon a time",
    "The best way to learn is",
    "In the year 2000,",
    "Cats and dogs are",
]
LONG = {"max_tokens": 480, "ignore_eos": True, "temperature": 0, "stream": True}
SAMPLE = re.compile(r"^(?P<name>[a-z_:]+)\{(?P<labels>[^}]*)\} (?P<value>\S+)$")


@pytest.fixture(scope="module")
def server():
    server = ServerProcess(None, *SERVER_ARGS)
    yield server
    server.signal(signal.SIGTERM)  # a drain and a clean stop of both cores
    try:
        assert server.wait(TIMEOUT_S) == 0, server.log_text
    finally:
        server.kill()
    assert_nothing_left(server)


def assert_nothing_left(server: ServerProcess) -> None:
    """Every engine core has exited and every IPC directory of the server is gone."""
    assert wait_for(lambda: not any(map(pid_is_alive, server.core_pids)), 15)
    assert len(server.ipc_dirs) >= 2  # one per core (and any that another test made)
    assert not any(folder.exists() for folder in server.ipc_dirs), "IPC files left"


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.address, timeout=TIMEOUT_S) as client:
        yield client


def complete(address: str, prompt: str, max_tokens: int = 8) -> str:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    response = httpx.post(address + "/v1/completions", json=body, timeout=TIMEOUT_S)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def complete_all(address: str, prompts: list[str]) -> list[str]:
    """The prompts' greedy completions, all requests in flight at once."""
    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda prompt: complete(address, prompt), prompts))


def scrape(client: httpx.Client) -> dict[tuple[str, str | None], float]:
    """``(name, engine label or None) -> value`` of every sample but histogram buckets."""
    response = client.get("/metrics")
    assert response.status_code == 200
    samples = {}
    for line in response.text.splitlines():
        match = SAMPLE.match(line)
        if match is None or 'le="' in match["labels"]:
            continue
        engine = re.search(r'engine="([^"]*)"', match["labels"])
        samples[match["name"], engine and engine.group(1)] = float(match["value"])
    return samples


def per_engine_names(samples: dict) -> set[str]:
    return {name for name, engine in samples if engine is not None}


def wait_for_event(lines: Iterator[str]) -> None:
    """Read a server-sent event stream up to its first data event (and no further)."""
    for line in lines:
        if line.startswith("data: {"):
            return
    raise AssertionError("the stream ended without an event")


def wait_for(condition, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


def test_a_batch_completes_with_the_text_of_one_engine(server):
    llm = LLM(cpu_threads=1, max_model_len=512, num_kv_blocks=64)
    params = SamplingParams(max_tokens=8, temperature=0)
    expected = [out.outputs[0].text for out in llm.generate(PROMPTS, params, use_tqdm=False)]

    assert complete_all(server.address, PROMPTS) == expected


def test_both_cores_receive_work(server, client):
    before = scrape(client)

    complete_all(server.address, PROMPTS)

    after = scrape(client)
    for engine in ("0", "1"):
        key = ("vlite:prompt_tokens_total", engine)
        assert after[key] > before.get(key, 0), (engine, before, after)


def test_metrics_label_each_engine_and_totals_are_their_sums(server, client):
    complete(server.address, PROMPTS[0])
    samples = scrape(client)

    names = per_engine_names(samples)
    assert {"vlite:num_requests_running", "vlite:engine_steps_total"} <= names
    for name in names:
        engines = sorted(engine for sample, engine in samples if sample == name and engine)
        assert engines == ["0", "1"], name
        parts = [samples[name, "0"], samples[name, "1"]]
        total = samples[name, None]
        if name == "vlite:engine_healthy":
            assert total == min(parts) == 1
        elif name == "vlite:kv_cache_usage_perc":  # both cores have 64 blocks
            assert total == pytest.approx(sum(parts) / 2)
        else:
            assert total == sum(parts), name


def test_a_client_disconnect_frees_blocks_on_its_core_only(server, client):
    def running(samples: dict, engine: str) -> float:
        return samples["vlite:num_requests_running", engine]

    with httpx.Client(base_url=server.address, timeout=TIMEOUT_S) as other:
        leaving = contextlib.ExitStack()
        body = {**LONG, "prompt": "Hello"}
        response = leaving.enter_context(other.stream("POST", "/v1/completions", json=body))
        leaving_lines = response.iter_lines()  # kept: a dropped iterator closes the stream
        wait_for_event(leaving_lines)
        samples = scrape(client)
        (held,) = [e for e in ("0", "1") if running(samples, e) == 1]
        free = "1" if held == "0" else "0"
        with client.stream("POST", "/v1/completions", json={**LONG, "prompt": "Hi"}) as kept:
            kept_lines = kept.iter_lines()
            wait_for_event(kept_lines)
            assert running(scrape(client), free) == 1  # the second went to the idle core

            leaving.close()  # the first client goes away

            def freed() -> bool:
                samples = scrape(client)
                return (
                    running(samples, held) == 0 and samples["vlite:kv_cache_usage_perc", held] == 0
                )

            assert wait_for(freed), scrape(client)
            samples = scrape(client)
            assert running(samples, free) == 1
            assert samples["vlite:kv_cache_usage_perc", free] > 0


@pytest.mark.parametrize("flag", [("-dp", "0"), ("--data-parallel-size", "-1")])
def test_a_data_parallel_size_below_one_is_refused(flag):
    result = CliRunner().invoke(cli, ["serve", *flag])

    assert result.exit_code == 2
    assert f"invalid data_parallel_size={flag[1]}" in result.output
    assert "greater than or equal to 1" in result.output


def core_stats(running: int, used_blocks: int, num_blocks: int, steps: int) -> EngineCoreStats:
    return EngineCoreStats(
        num_kv_blocks=num_blocks,
        num_free_kv_blocks=num_blocks - used_blocks,
        kv_cache_usage=used_blocks / num_blocks,
        num_unfinished_requests=running,
        num_running_requests=running,
        num_waiting_requests=0,
        num_failed_steps=0,
        totals=StepTotals(num_steps=steps, num_generation_tokens=2 * steps),
    )


def parse(text: str) -> dict[tuple[str, str | None], float]:
    samples = {}
    for line in text.splitlines():
        if match := SAMPLE.match(line):
            engine = re.search(r'engine="([^"]*)"', match["labels"])
            samples[match["name"], engine and engine.group(1)] = float(match["value"])
    return samples


def test_rendered_totals_sum_the_engines_and_weigh_kv_usage_by_blocks():
    samples = parse(render_metrics([core_stats(2, 10, 100, 7), core_stats(1, 0, 300, 5)], "m"))

    assert samples["vlite:num_requests_running", None] == 3
    assert samples["vlite:num_requests_running", "1"] == 1
    assert samples["vlite:engine_steps_total", None] == 12
    assert samples["vlite:generation_tokens_total", "0"] == 14
    assert samples["vlite:num_kv_cache_blocks", None] == 400
    assert samples["vlite:kv_cache_usage_perc", None] == pytest.approx(10 / 400)
    assert samples["vlite:engine_healthy", None] == 1


def test_a_dead_engine_keeps_the_others_series_and_drops_the_totals():
    samples = parse(render_metrics([core_stats(2, 10, 100, 7), None], "m"))

    assert samples["vlite:engine_healthy", None] == 0
    assert (samples["vlite:engine_healthy", "0"], samples["vlite:engine_healthy", "1"]) == (1, 0)
    assert samples["vlite:num_requests_running", "0"] == 2
    assert ("vlite:num_requests_running", None) not in samples
    assert ("vlite:num_requests_running", "1") not in samples


@pytest.mark.parametrize(
    ("cores", "data_parallel_size", "threads"),
    [(2, 1, None), (2, 2, 1), (3, 2, 1), (8, 1, 7), (8, 2, 3), (8, 4, 1)],
)
def test_the_server_splits_the_cores_over_the_engine_cores(
    monkeypatch, cores, data_parallel_size, threads
):
    monkeypatch.setattr(api_server, "physical_cores", lambda: cores)
    monkeypatch.setattr("vlite.worker.cpu_threads.physical_cores", lambda cpus=None: cores)
    monkeypatch.delenv("VLITE_CPU_THREADS", raising=False)

    config = api_server.with_serving_defaults(VliteConfig(), None, {}, data_parallel_size)
    chosen = api_server.with_serving_defaults(
        VliteConfig(cpu_threads=2), None, {"cpu_threads": 2}, data_parallel_size
    )

    assert config.cpu_threads == threads
    assert chosen.cpu_threads == 2  # a thread count the user set is kept


class HealthWatch:
    """Polls ``/health`` on a thread until it answers 503 (then records when, monotonic,
    and its message) or the server stops answering (then records the error)."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.unhealthy_at: float | None = None
        self.message = ""
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        with httpx.Client(timeout=5) as client:
            while self.unhealthy_at is None:
                try:
                    response = client.get(self.address + "/health")
                except httpx.HTTPError as exc:
                    self.message = f"no answer: {exc!r}"
                    return
                if response.status_code == 503:
                    self.unhealthy_at = time.monotonic()
                    self.message = response.json()["error"]["message"]
                time.sleep(0.01)

    def join(self) -> None:
        self._thread.join(TIMEOUT_S)


def read_stream(address: str, prompt: str, events: list[str], first: threading.Event) -> None:
    try:
        with httpx.stream(
            "POST", address + "/v1/completions", json={**LONG, "prompt": prompt}, timeout=60
        ) as response:
            for line in response.iter_lines():
                if line:
                    events.append(line.removeprefix("data: "))
                    first.set()
    except httpx.HTTPError as exc:
        events.append(f"transport error: {exc!r}")
    finally:
        first.set()


def test_a_killed_core_is_reported_and_fails_the_requests_in_flight():
    server = ServerProcess(None, *SERVER_ARGS)
    try:
        streams = []
        for prompt in ("Once upon a time", "Far, far away"):  # the second: to the idle core
            events: list[str] = []
            first = threading.Event()
            thread = threading.Thread(
                target=read_stream, args=(server.address, prompt, events, first), daemon=True
            )
            thread.start()
            assert first.wait(TIMEOUT_S) and events, events
            streams.append((thread, events))
        watch = HealthWatch(server.address)
        killed_at = time.monotonic()
        os.kill(server.core_pids[1], signal.SIGKILL)
        for thread, _ in streams:
            thread.join(TIMEOUT_S)
            assert not thread.is_alive(), "a stream hung"
        failed_after_s = time.monotonic() - killed_at
        watch.join()
        exit_code = server.wait(TIMEOUT_S)

        assert watch.unhealthy_at is not None, (watch.message, server.log_text)
        detected_after_s = watch.unhealthy_at - killed_at
        print(f"\nhealth 503 {detected_after_s:.3f} s, streams ended {failed_after_s:.3f} s "
              f"after the SIGKILL")  # fmt: skip
        assert "engine core 1 of 2" in watch.message and str(server.core_pids[1]) in watch.message
        assert detected_after_s < 2.0
        for _, events in streams:
            assert events[-1] == "[DONE]", events[-3:]
            error = json.loads(events[-2])["error"]
            assert "engine core 1 of 2" in error["message"], error
        assert exit_code == 1, server.log_text
        assert "engine core died" in server.log_text
        assert_nothing_left(server)
    finally:
        server.kill()
