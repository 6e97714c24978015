"""How quickly ``/health`` answers while ``vlite serve`` handles large prompts.

Starts ``vlite serve`` (the default model unless ``--model``), then, for ``--rounds``
rounds, sends ``--concurrency`` requests whose prompts are ``--prompt-chars`` characters of
text (tokenized by the server, then refused or run), while a client polls ``/health`` every
5 ms. Prints the health latencies (median, p99, max) measured during the large requests,
and the same without them, as a baseline. The target: p99 under 50 ms.

    python benchmarks/health_latency.py
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time

import httpx

from vlite.bench.percentiles import percentile
from vlite.testing.server_process import ServerProcess

WORDS = ["river", "stone", "lantern", "copper", "meadow", "quiet", "engine", "harbor"]


async def poll_health(client: httpx.AsyncClient, stop: asyncio.Event) -> list[float]:
    latencies = []
    while not stop.is_set():
        start = time.perf_counter()
        response = await client.get("/health")
        latencies.append(time.perf_counter() - start)
        assert response.status_code == 200
        await asyncio.sleep(0.005)
    return latencies


async def big_request(client: httpx.AsyncClient, text: str) -> tuple[int, float]:
    start = time.perf_counter()
    response = await client.post("/v1/completions", json={"prompt": text, "max_tokens": 4})
    return response.status_code, time.perf_counter() - start


async def measure(args, address: str) -> None:
    rng = random.Random(0)
    async with (
        httpx.AsyncClient(base_url=address, timeout=300) as health_client,
        httpx.AsyncClient(base_url=address, timeout=300) as client,
    ):
        stop = asyncio.Event()
        idle_poller = asyncio.create_task(poll_health(health_client, stop))
        await asyncio.sleep(2)
        stop.set()
        idle = await idle_poller

        loaded: list[float] = []
        outcomes: list[tuple[int, float]] = []
        for _ in range(args.rounds):
            texts = [
                " ".join(rng.choice(WORDS) for _ in range(args.prompt_chars // 6))
                for _ in range(args.concurrency)
            ]
            stop = asyncio.Event()
            poller = asyncio.create_task(poll_health(health_client, stop))
            outcomes += await asyncio.gather(*(big_request(client, t) for t in texts))
            stop.set()
            loaded += await poller

    def describe(values: list[float]) -> str:
        ms = [v * 1e3 for v in values]
        return (
            f"median {percentile(ms, 50):6.1f} ms, p99 {percentile(ms, 99):6.1f} ms, "
            f"max {max(ms):6.1f} ms ({len(ms)} probes)"
        )

    statuses = sorted({status for status, _ in outcomes})
    print(
        f"{args.rounds} rounds of {args.concurrency} requests of {args.prompt_chars} characters "
        f"(answered {statuses}; each took {describe([d for _, d in outcomes])})"
    )
    print(f"  /health while idle:            {describe(idle)}")
    print(f"  /health during large requests: {describe(loaded)}  (target: p99 < 50 ms)")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--model", help="model for vlite serve; default: vlite's default")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--prompt-chars", type=int, default=100_000)
    args = parser.parse_args()
    server = ServerProcess(args.model)
    try:
        asyncio.run(measure(args, server.address))
    finally:
        server.kill()


if __name__ == "__main__":
    main()
