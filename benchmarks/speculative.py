"""Speculative decoding on CPU: one stream, with and without drafts, per kind of work.

Each ``--task`` is one chat request to the default model (or ``--model``), generated
greedily until the model ends its answer (at most ``--max-tokens``): speculation keeps the
model's own tokens, so both engines produce the same text (checked: a trial whose tokens
differ from the plain engine's fails the comparison printed at the end). Output tokens/s =
output tokens / wall time of the whole generation, prefill included, in each trial's fresh
process after one warm-up generation of another task.

* ``vlite``: ``LLM(**settings)``, no speculation;
* ``vlite-ngram``: the same with ``speculative_config={"method": "ngram",
  "num_speculative_tokens": K, "prompt_lookup_max": 5, "prompt_lookup_min": 2}``
  (``--num-speculative-tokens``); its acceptance (accepted / drafted tokens) is printed;
* ``vlite-draft``: ``speculative_config={"method": "draft_model", "model": DRAFT,
  "num_speculative_tokens": K}`` (``--draft-model``);
* ``llama.cpp``, ``llama.cpp-ngram``, ``llama.cpp-draft``: ``llama-server -m FILE -np 1
  -t T -tb T`` (``--llama-server``, or beside ``$LLAMA_CPP_LIB_PATH``), plain, with
  ``--spec-type ngram-simple --spec-draft-n-max K``, or with ``-md DRAFT --spec-draft-n-max
  K``; the same chat requests at temperature 0 through ``/v1/chat/completions``, output
  tokens from its ``usage``. llama.cpp takes a GGUF ``--model``. Its rows' peak RSS is the
  client's (the trial process), not the server's.

``--engines`` picks them (default: ``vlite,vlite-ngram``, and ``vlite-draft`` with
``--draft-model``).

Tasks: ``edit`` (rewrite a given function with one change), ``quote`` (answer with a
sentence quoted from a given text), ``record`` (fill a JSON record from a given document):
work grounded in its input, where drafts copied from the prompt are often right; ``chat``:
an open-ended answer, where they rarely are. Rounds alternate the engines (``harness.py``).

    python benchmarks/speculative.py --threads 2 --rounds 3 --background-load 0
    python benchmarks/speculative.py --task chat --threads 2 --rounds 3 --background-load 0
    python benchmarks/speculative.py --model target-f16.gguf --draft-model draft-q4_1.gguf \
        --engines vlite,vlite-draft,llama.cpp,llama.cpp-draft --threads 2 --rounds 3
"""

from __future__ import annotations

import argparse
import contextlib
import time
from pathlib import Path
from typing import Any

import harness  # benchmarks/harness.py: run as a script, its folder is on sys.path
import serving  # benchmarks/serving.py: its llama-server launcher

TASKS: dict[str, str] = {
    "edit": (
        "Rename the variable `count` to `total` in this Python function and give back the "
        "whole function, nothing else.\n\n```python\ndef summarize(values):\n"
        "    count = 0\n    largest = None\n    for value in values:\n"
        "        count += value\n        if largest is None or value > largest:\n"
        "            largest = value\n    average = count / len(values)\n"
        "    return {'count': count, 'largest': largest, 'average': average}\n```"
    ),
    "quote": (
        "Text: The lighthouse on the north cape was built in 1871 from granite quarried on "
        "the island. Its lamp burned whale oil until 1904, when a kerosene burner replaced "
        "it. The keeper's house beside the tower now holds a small museum of shipwrecks. "
        "Visitors can climb the 112 steps to the gallery from May to September.\n\n"
        "Quote, word for word, the sentence of the text that says when visitors can climb "
        "the tower."
    ),
    "record": (
        "Document: Maria Lopez, 34, moved to Lisbon in 2019 to work as a marine biologist at "
        "the Oceanographic Institute. She can be reached at maria.lopez@example.org or on "
        "+351 555 0199.\n\nFill this JSON record from the document and output only the "
        'JSON: {"name": "", "age": 0, "city": "", "occupation": "", "email": "", '
        '"phone": ""}'
    ),
    "chat": "Tell me a short story about a robot who learns to paint.",
}
WARM_UP = "Write two sentences about the sea."


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=harness.HelpFormatter)
    parser.add_argument("--model", type=Path, help="model for vlite; default: vlite's own")
    parser.add_argument(
        "--task", choices=sorted(TASKS), nargs="+", default=["edit", "quote", "record"]
    )
    parser.add_argument("--max-tokens", type=int, default=160, help="most output tokens")
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument(
        "--draft-model", type=Path, help="the draft model of vlite-draft and llama.cpp-draft"
    )
    parser.add_argument(
        "--engines",
        type=lambda text: text.split(","),
        help=f"comma-separated, of {', '.join(ENGINES)}; default: vlite,vlite-ngram "
        "(and vlite-draft with --draft-model)",
    )
    parser.add_argument("--llama-server", type=Path, help="llama.cpp's llama-server binary")
    harness.add_vlite_options(parser)
    harness.add_harness_options(parser, default_threads=[harness.available_cores()])
    args = parser.parse_args()
    if args.engines is None:
        args.engines = ["vlite", "vlite-ngram"] + (["vlite-draft"] if args.draft_model else [])
    unknown = sorted(set(args.engines) - set(ENGINES))
    if unknown:
        parser.error(f"--engines: unknown {', '.join(unknown)}; allowed: {', '.join(ENGINES)}")
    if any(name.endswith("-draft") for name in args.engines) and args.draft_model is None:
        parser.error("the -draft engines need --draft-model")
    if any(name.startswith("llama.cpp") for name in args.engines) and not args.worker:
        if args.model is None or args.model.suffix != ".gguf":
            parser.error("llama.cpp takes a GGUF file: give --model FILE.gguf")
        args.llama_server = args.llama_server or serving.find_llama_server()
        if args.llama_server is None:
            parser.error("llama-server not found: give --llama-server PATH")
    return args


def speculative_config(args: argparse.Namespace, method: str = "ngram") -> dict[str, Any]:
    if method == "draft_model":
        return {
            "method": "draft_model",
            "model": str(args.draft_model),
            "num_speculative_tokens": args.num_speculative_tokens,
        }
    return {
        "method": "ngram",
        "num_speculative_tokens": args.num_speculative_tokens,
        "prompt_lookup_max": 5,
        "prompt_lookup_min": 2,
    }


def run(args: argparse.Namespace, method: str | None) -> dict[str, Any]:
    from vlite import SamplingParams

    settings = harness.parse_settings(args.vlite_setting)
    if method is not None:
        settings["speculative_config"] = speculative_config(args, method)
    model = str(args.model) if args.model else None
    llm, _ = harness.make_vlite_llm(model, settings, args.threads[0])
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)

    def chat(text: str) -> list[int]:
        messages = [{"role": "user", "content": text}]
        outputs = llm.chat([messages], params, use_tqdm=False)
        return list(outputs[0].outputs[0].token_ids)

    chat(WARM_UP)
    scheduler = llm.llm_engine.engine_core.scheduler
    drafted, accepted = scheduler.num_draft_tokens, scheduler.num_accepted_tokens
    start = time.perf_counter()
    tokens = [chat(TASKS[task]) for task in args.task]
    seconds = time.perf_counter() - start
    drafted = scheduler.num_draft_tokens - drafted
    accepted = scheduler.num_accepted_tokens - accepted
    return {
        "seconds": seconds,
        "output_tokens": sum(map(len, tokens)),
        "first_output_ids": [ids[:8] for ids in tokens],
        "drafted_tokens": drafted,
        "accepted_tokens": accepted,
        "acceptance": accepted / drafted if drafted else None,
    }


def llama_cpp_argv(args: argparse.Namespace, method: str | None, port: int) -> list[str]:
    """``llama-server`` serving ``--model`` to one stream, speculating with ``method``."""
    threads = str(args.threads[0])
    argv = [str(args.llama_server), "-m", str(args.model), "--host", "127.0.0.1"]
    argv += ["--port", str(port), "-np", "1", "-t", threads, "-tb", threads, "-c", "4096"]
    drafts = str(args.num_speculative_tokens)
    if method == "ngram":
        argv += ["--spec-type", "ngram-simple", "--spec-draft-n-max", drafts]
    elif method == "draft_model":
        argv += ["-md", str(args.draft_model), "--spec-draft-n-max", drafts, "-td", threads]
        argv += ["-tbd", threads]
    return argv


def run_llama_cpp(args: argparse.Namespace, method: str | None) -> dict[str, Any]:
    import httpx

    port = serving.free_port()
    argv = llama_cpp_argv(args, method, port)
    spec = serving.ServerSpec("llama.cpp", argv, {}, " ".join(argv))
    with contextlib.ExitStack() as stack:
        server = stack.enter_context(serving.Server(spec, port, serving.server_env(1)))
        server.wait_until_healthy(300)
        client = stack.enter_context(httpx.Client(base_url=server.url, timeout=600))

        def chat(text: str) -> int:
            body = {
                "messages": [{"role": "user", "content": text}],
                "max_tokens": args.max_tokens,
                "temperature": 0.0,
            }
            response = client.post("/v1/chat/completions", json=body)
            response.raise_for_status()
            return response.json()["usage"]["completion_tokens"]

        chat(WARM_UP)
        start = time.perf_counter()
        num_tokens = sum(chat(TASKS[task]) for task in args.task)
        seconds = time.perf_counter() - start
    return {"seconds": seconds, "output_tokens": num_tokens, "server": " ".join(argv[1:])}


WORKERS: dict[str, harness.WorkerFunction] = {
    "vlite": lambda args: run(args, None),
    "vlite-ngram": lambda args: run(args, "ngram"),
    "vlite-draft": lambda args: run(args, "draft_model"),
    "llama.cpp": lambda args: run_llama_cpp(args, None),
    "llama.cpp-ngram": lambda args: run_llama_cpp(args, "ngram"),
    "llama.cpp-draft": lambda args: run_llama_cpp(args, "draft_model"),
}
ENGINES = tuple(WORKERS)


def main() -> None:
    args = parse_args()
    if args.worker:
        harness.run_worker(args, WORKERS)
    harness.check_harness_options(args)
    flags = harness.setting_flags(args.vlite_setting)
    engines = [harness.Engine(name, name, flags) for name in args.engines]
    worker_args = ["--max-tokens", str(args.max_tokens), "--task", *args.task]
    worker_args += ["--num-speculative-tokens", str(args.num_speculative_tokens)]
    for option in ("model", "draft_model", "llama_server"):
        if getattr(args, option):
            worker_args += [f"--{option.replace('_', '-')}", str(getattr(args, option))]
    title = (
        f"speculative decoding, one stream: tasks {', '.join(args.task)} one after another, "
        f"greedy chat answers (at most {args.max_tokens} tokens), tok/s = output tokens / "
        f"wall time; {args.num_speculative_tokens} drafts a step"
    )
    settings = {"tasks": args.task, "max_tokens": args.max_tokens, **speculative_config(args)}
    if args.draft_model:
        settings["draft_model"] = str(args.draft_model)
    configurations = harness.run_benchmark(
        harness.Plan(Path(__file__).resolve(), title, engines, worker_args, settings), args
    )
    for configuration in configurations:
        for trial in configuration.trials:
            if trial.details.get("acceptance") is not None:
                print(
                    f"round {trial.round}: {trial.engine} drafted "
                    f"{trial.details['drafted_tokens']}, accepted "
                    f"{trial.details['accepted_tokens']} ({trial.details['acceptance']:.0%})"
                )


if __name__ == "__main__":
    main()
