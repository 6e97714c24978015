"""Soak test of ``vlite serve``: hours of traffic in minutes, watched for leaks.

Starts ``vlite serve`` (the default model unless ``--model``) and keeps ``--concurrency``
streams busy for ``--minutes``: most requests stream a completion to its end, ``--abort-rate``
of them disconnect after a few tokens, ``--invalid-rate`` are malformed. Every 10 s it
samples the resident memory and open file descriptors of the server and its engine core.
At the end it stops sending, waits for the server to go idle and checks the idle
invariant (no request running or waiting, no KV block in use).

It passes when no request got a 5xx (or a broken stream), memory grew less than 5%
between minute 2 and the end, file descriptors stayed within 10 of minute 2's, and the
server went idle. Run by hand (it is not a CI test):

    python benchmarks/soak.py                       # 10 minutes, 8 streams, default model
    python benchmarks/soak.py --minutes 1 --model path/to/hf-folder
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from dataclasses import dataclass, field

import httpx

from vlite.testing.server_process import ServerProcess

SAMPLE_EVERY_S = 10.0
PROMPTS = [
    "Write a short story about a lighthouse keeper.",
    "Explain how a bicycle stays upright.",
    "List five uses for a paperclip.",
    "What is the capital of France? Answer in one sentence.",
    "Describe the water cycle to a child.",
    "Give me three tips for learning a new language.",
]
MALFORMED = [
    {"prompt": "x", "max_tokens": 2**64},
    {"prompt": "x", "temperature": "hot"},
    {"prompt": ["a", "b"]},
    {"prompt": "x", "n": 10**6},
    {"max_tokens": 3},
    {"prompt": "x", "stop": ["s" * 1000]},
    {"prompt": [1, -2]},
    {"prompt": "x", "best_of": 3},
]


@dataclass
class Tally:
    ok: int = 0
    aborted: int = 0
    client_errors: int = 0
    server_errors: int = 0
    broken_streams: int = 0
    transport_errors: int = 0
    failures: list[str] = field(default_factory=list)

    def fail(self, what: str) -> None:
        if len(self.failures) < 20:
            self.failures.append(what)


def process_sample(pid: int) -> tuple[float, int]:
    """(resident MiB, open file descriptors) of a process."""
    rss_kib = 0
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                rss_kib = int(line.split()[1])
    return rss_kib / 1024, len(os.listdir(f"/proc/{pid}/fd"))


async def stream_one(client: httpx.AsyncClient, rng: random.Random, tally: Tally, abort: bool):
    body = {
        "prompt": rng.choice(PROMPTS),
        "max_tokens": rng.randint(16, 64),
        "temperature": rng.choice([0.0, 0.7]),
        "seed": rng.randrange(1000),
        "stream": True,
    }
    async with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code >= 500:
            tally.server_errors += 1
            tally.fail(f"{response.status_code}: {(await response.aread())[:200]!r}")
            return
        if response.status_code != 200:
            tally.client_errors += 1
            tally.fail(f"good request got {response.status_code}")
            return
        events = 0
        last = ""
        async for line in response.aiter_lines():
            if not line:
                continue
            events += 1
            last = line
            if '"error"' in line:
                tally.broken_streams += 1
                tally.fail(f"error event: {line[:200]}")
            if abort:  # after the first event
                tally.aborted += 1
                return  # leaving the block closes the connection mid-stream
        if last != "data: [DONE]":
            tally.broken_streams += 1
            tally.fail(f"stream ended without [DONE]: {last[:200]}")
        else:
            tally.ok += 1


async def send_malformed(client: httpx.AsyncClient, rng: random.Random, tally: Tally) -> None:
    response = await client.post("/v1/completions", json=rng.choice(MALFORMED))
    if response.status_code >= 500:
        tally.server_errors += 1
        tally.fail(f"malformed request got {response.status_code}: {response.text[:200]}")
    elif 400 <= response.status_code < 500:
        tally.client_errors += 1
    else:
        tally.fail(f"malformed request got {response.status_code}")


async def worker(args, address: str, seed: int, deadline: float, tally: Tally) -> None:
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=address, timeout=120) as client:
        while time.monotonic() < deadline:
            roll = rng.random()
            try:
                if roll < args.invalid_rate:
                    await send_malformed(client, rng, tally)
                else:
                    abort = roll < args.invalid_rate + args.abort_rate
                    await stream_one(client, rng, tally, abort)
            except httpx.HTTPError as exc:
                tally.transport_errors += 1
                tally.fail(f"{type(exc).__name__}: {exc}")


async def sampler(pids: dict[str, int], deadline: float, samples: list[dict]) -> None:
    start = time.monotonic()
    while time.monotonic() < deadline:
        sample = {"t_s": round(time.monotonic() - start, 1)}
        for name, pid in pids.items():
            sample[f"{name}_rss_mib"], sample[f"{name}_fds"] = process_sample(pid)
        samples.append(sample)
        await asyncio.sleep(SAMPLE_EVERY_S)


def gauges(address: str) -> dict[str, float]:
    values = {}
    for line in httpx.get(address + "/metrics", timeout=30).text.splitlines():
        if line.startswith("vlite:") and "{" in line and 'le="' not in line:
            name = line.split("{", 1)[0].removeprefix("vlite:")
            values[name] = float(line.rsplit(" ", 1)[1])
    return values


def wait_idle(address: str, timeout_s: float = 30.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout_s
    while True:
        values = gauges(address)
        idle = (
            values["num_requests_running"] == 0
            and values["num_requests_waiting"] == 0
            and values["kv_cache_usage_perc"] == 0
        )
        if idle or time.monotonic() > deadline:
            return values
        time.sleep(0.2)


def at_minute(samples: list[dict], minute: float) -> dict:
    return min(samples, key=lambda s: abs(s["t_s"] - 60 * minute))


async def soak(args, server: ServerProcess) -> dict:
    tally = Tally()
    samples: list[dict] = []
    deadline = time.monotonic() + args.minutes * 60
    pids = {"front_end": server.process.pid, "engine_core": server.core_pid}
    await asyncio.gather(
        sampler(pids, deadline, samples),
        *(worker(args, server.address, i, deadline, tally) for i in range(args.concurrency)),
    )
    idle = wait_idle(server.address)
    samples.append(
        {"t_s": round(args.minutes * 60, 1)}
        | {
            f"{n}_{k}": v
            for n, pid in pids.items()
            for k, v in zip(("rss_mib", "fds"), process_sample(pid))
        }  # noqa: E501
    )
    return {"tally": tally, "samples": samples, "idle": idle}


def report(args, result: dict) -> bool:
    tally, samples, idle = result["tally"], result["samples"], result["idle"]
    start_minute = min(2.0, args.minutes / 2)
    early, last = at_minute(samples, start_minute), samples[-1]
    checks = {
        "no 5xx or broken stream": tally.server_errors + tally.broken_streams == 0,
        "no transport error": tally.transport_errors == 0,
        "idle after the drain": idle["num_requests_running"] == 0
        and idle["num_requests_waiting"] == 0
        and idle["kv_cache_usage_perc"] == 0,
    }
    print(f"soak: {args.minutes:g} minutes, {args.concurrency} streams, "
          f"{args.abort_rate:.0%} aborts, {args.invalid_rate:.0%} invalid")  # fmt: skip
    print(
        f"  requests: {tally.ok} completed, {tally.aborted} aborted by the client, "
        f"{tally.client_errors} answered 4xx, {tally.server_errors} answered 5xx, "
        f"{tally.broken_streams} broken streams, {tally.transport_errors} transport errors"
    )
    for name in ("front_end", "engine_core"):
        before, after = early[f"{name}_rss_mib"], last[f"{name}_rss_mib"]
        growth = (after - before) / before
        fds_before, fds_after = early[f"{name}_fds"], last[f"{name}_fds"]
        checks[f"{name} memory growth < 5%"] = growth < 0.05
        checks[f"{name} file descriptors stable"] = abs(fds_after - fds_before) <= 10
        print(f"  {name}: RSS {before:.0f} MiB at minute {start_minute:g} -> {after:.0f} MiB at "
              f"the end ({growth:+.1%}); open fds {fds_before} -> {fds_after}")  # fmt: skip
    print(
        f"  after the drain: {idle['num_requests_running']:.0f} running, "
        f"{idle['num_requests_waiting']:.0f} waiting, "
        f"KV usage {idle['kv_cache_usage_perc']:.0%}"
    )
    for what, passed in checks.items():
        print(f"  {'PASS' if passed else 'FAIL'}  {what}")
    for failure in tally.failures:
        print(f"  failure: {failure}")
    if args.json:
        print(json.dumps({"tally": tally.__dict__, "samples": samples, "checks": checks}))
    return all(checks.values())


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--model", help="model for vlite serve; default: vlite's default")
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--abort-rate", type=float, default=0.05)
    parser.add_argument("--invalid-rate", type=float, default=0.05)
    parser.add_argument("--server-args", default="", help="more vlite serve flags")
    parser.add_argument("--json", action="store_true", help="also print the raw figures")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    server_args = args.server_args.split()
    if args.model:
        server_args = ["--model", args.model, *server_args]
    server = ServerProcess(None, *server_args)
    try:
        passed = report(args, asyncio.run(soak(args, server)))
    finally:
        server.kill()
    sys.exit(0 if passed else 1)


if __name__ == "__main__":
    main()
