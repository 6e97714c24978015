"""Speculative decoding on CPU: one stream, with and without n-gram drafts, per kind of work.

Each ``--task`` is one chat request to the default model (or ``--model``), generated
greedily until the model ends its answer (at most ``--max-tokens``): speculation keeps the
model's own tokens, so both engines produce the same text (checked: a trial whose tokens
differ from the plain engine's fails the comparison printed at the end). Output tokens/s =
output tokens / wall time of the whole generation, prefill included, in each trial's fresh
process after one warm-up generation of another task.

* ``vlite``: ``LLM(**settings)``, no speculation;
* ``vlite-ngram``: the same with ``speculative_config={"method": "ngram",
  "num_speculative_tokens": K, "prompt_lookup_max": 5, "prompt_lookup_min": 2}``
  (``--num-speculative-tokens``); its acceptance (accepted / drafted tokens) is printed.

Tasks: ``edit`` (rewrite a given function with one change), ``quote`` (answer with a
sentence quoted from a given text), ``record`` (fill a JSON record from a given document):
work grounded in its input, where drafts copied from the prompt are often right; ``chat``:
an open-ended answer, where they rarely are. Rounds alternate the engines (``harness.py``).

    python benchmarks/speculative.py --threads 2 --rounds 3 --background-load 0
    python benchmarks/speculative.py --task chat --threads 2 --rounds 3 --background-load 0
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import harness  # benchmarks/harness.py: run as a script, its folder is on sys.path

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
    harness.add_vlite_options(parser)
    harness.add_harness_options(parser, default_threads=[harness.available_cores()])
    return parser.parse_args()


def speculative_config(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "method": "ngram",
        "num_speculative_tokens": args.num_speculative_tokens,
        "prompt_lookup_max": 5,
        "prompt_lookup_min": 2,
    }


def run(args: argparse.Namespace, speculate: bool) -> dict[str, Any]:
    from vlite import SamplingParams

    settings = harness.parse_settings(args.vlite_setting)
    if speculate:
        settings["speculative_config"] = speculative_config(args)
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


WORKERS: dict[str, harness.WorkerFunction] = {
    "vlite": lambda args: run(args, speculate=False),
    "vlite-ngram": lambda args: run(args, speculate=True),
}


def main() -> None:
    args = parse_args()
    if args.worker:
        harness.run_worker(args, WORKERS)
    harness.check_harness_options(args)
    flags = harness.setting_flags(args.vlite_setting)
    engines = [harness.Engine(name, name, flags) for name in WORKERS]
    worker_args = ["--max-tokens", str(args.max_tokens), "--task", *args.task]
    worker_args += ["--num-speculative-tokens", str(args.num_speculative_tokens)]
    if args.model:
        worker_args += ["--model", str(args.model)]
    title = (
        f"speculative decoding, one stream: tasks {', '.join(args.task)} one after another, "
        f"greedy chat answers (at most {args.max_tokens} tokens), tok/s = output tokens / "
        f"wall time; ngram with {args.num_speculative_tokens} drafts"
    )
    settings = {"tasks": args.task, "max_tokens": args.max_tokens, **speculative_config(args)}
    configurations = harness.run_benchmark(
        harness.Plan(Path(__file__).resolve(), title, engines, worker_args, settings), args
    )
    for configuration in configurations:
        for trial in configuration.trials:
            if trial.engine == "vlite-ngram" and trial.details.get("acceptance") is not None:
                print(
                    f"round {trial.round}: ngram drafted {trial.details['drafted_tokens']}, "
                    f"accepted {trial.details['accepted_tokens']} "
                    f"({trial.details['acceptance']:.0%})"
                )


if __name__ == "__main__":
    main()
