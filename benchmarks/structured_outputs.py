"""Structured outputs: a JSON-schema workload's tokens/s against the same work unconstrained,
and grammar compile times.

The workload is ``--num-requests`` chat requests cycling through the twenty schemas of
``vlite/bench/json_schemas.py`` ("Describe a city as a JSON object.", ...), greedy, all
submitted at once to ``LLM.generate``:

* ``vlite``: each request constrained by its schema (``structured_outputs``, backend
  ``--backend``), so its output ends when the JSON is complete; the warm-up ran the same
  schemas on other prompts, so their grammars are compiled (a server that has seen them);
* ``vlite-cold``: the same, with grammars compiled during the timed run (a server meeting
  twenty new schemas at once);
* ``vlite-unconstrained``: the same prompts without constraints, each generating exactly
  as many tokens as its constrained run did (``ignore_eos``; the lengths come from one
  untimed constrained run in the parent before the rounds), so both rows do the same
  forward passes and the ratio is the cost of the masks alone.

Output tokens/s = output tokens / wall time of the workload, in each trial's fresh process
after a warm-up request on another prompt; rounds alternate the two rows (see
``harness.py``). Then the compile time of each schema, per backend: a fresh backend (empty
caches) per repeat, the time from ``compile`` to the first filled mask (llguidance compiles
lazily, so its first mask holds its work), ``--compile-repeats`` times, p50 and p99.

    python benchmarks/structured_outputs.py                  # all cores, 40 requests, 3 rounds
    python benchmarks/structured_outputs.py --backend llguidance --threads 1 2
    python benchmarks/structured_outputs.py --threads 1 --rounds 1 --quick --num-requests 4
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import harness  # benchmarks/harness.py: run as a script, its folder is on sys.path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from vlite.bench.json_schemas import SCHEMAS, schema_prompt  # noqa: E402

COLD = "vlite-cold"
UNCONSTRAINED = "vlite-unconstrained"
BACKENDS = ("xgrammar", "llguidance")
MAX_TOKENS = 300


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=harness.HelpFormatter)
    parser.add_argument("--num-requests", type=int, default=40, help="requests in the workload")
    parser.add_argument("--backend", choices=BACKENDS, default="xgrammar")
    parser.add_argument(
        "--compile-repeats", type=int, default=5, help="compile timings per schema and backend"
    )
    parser.add_argument("--output-lens", help=argparse.SUPPRESS)  # JSON, set for the workers
    parser.add_argument("--grammars", choices=("warm", "cold"), help=argparse.SUPPRESS)
    harness.add_vlite_options(parser)
    harness.add_harness_options(parser, default_threads=[harness.available_cores()])
    return parser.parse_args()


def chat_prompts(llm: Any, num_requests: int) -> list[dict[str, Any]]:
    """The workload's prompts (chat-templated), cycling through the schemas."""
    return [
        llm.llm_engine.apply_chat_template(
            [{"role": "user", "content": schema_prompt(SCHEMAS[i % len(SCHEMAS)][0])}]
        )
        for i in range(num_requests)
    ]


def constrained_params(args: argparse.Namespace, num_requests: int) -> list[Any]:
    from vlite import SamplingParams

    return [
        SamplingParams(
            max_tokens=MAX_TOKENS,
            temperature=0.0,
            structured_outputs={"json": SCHEMAS[i % len(SCHEMAS)][1], "backend": args.backend},
        )
        for i in range(num_requests)
    ]


def make_llm(args: argparse.Namespace) -> Any:
    settings = {"max_model_len": 1024, **harness.parse_settings(args.vlite_setting)}
    llm, _ = harness.make_vlite_llm(None, settings, args.threads[0])
    return llm


def warm_up(llm: Any, args: argparse.Namespace, with_schemas: bool = False) -> None:
    """One short request, constrained so the backend is built (its tokenizer tables are a
    one-time cost); ``with_schemas``: also every schema once, on prompts that share no
    prefix with the workload's (so no timed prefill is skipped)."""
    from vlite import SamplingParams

    choice = {"choice": ["yes", "no"], "backend": args.backend}
    prompts = ["Warm-up: yes or no?"]
    params = [SamplingParams(max_tokens=4, structured_outputs=choice)]
    if with_schemas:
        prompts += [f"Warm-up {i}: JSON please." for i in range(len(SCHEMAS))]
        params += [
            SamplingParams(max_tokens=2, structured_outputs={"json": s, "backend": args.backend})
            for _, s in SCHEMAS
        ]
    llm.generate(prompts, params, use_tqdm=False)


# ---- the workers ----------------------------------------------------------------------


def run_constrained(args: argparse.Namespace) -> dict[str, Any]:
    llm = make_llm(args)
    prompts = chat_prompts(llm, args.num_requests)
    params = constrained_params(args, args.num_requests)
    warm_up(llm, args, with_schemas=args.grammars == "warm")
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    lengths = [len(output.outputs[0].token_ids) for output in outputs]
    unfinished = sum(output.outputs[0].finish_reason != "stop" for output in outputs)
    return {"seconds": seconds, "output_tokens": sum(lengths), "unfinished": unfinished}


def run_unconstrained(args: argparse.Namespace) -> dict[str, Any]:
    from vlite import SamplingParams

    lengths = json.loads(args.output_lens)
    llm = make_llm(args)
    prompts = chat_prompts(llm, args.num_requests)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths]
    warm_up(llm, args)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    produced = sum(len(output.outputs[0].token_ids) for output in outputs)
    harness.check_token_count(UNCONSTRAINED, produced, sum(lengths))
    return {"seconds": seconds, "output_tokens": produced}


WORKERS: dict[str, harness.WorkerFunction] = {
    harness.REFERENCE_ENGINE: run_constrained,
    UNCONSTRAINED: run_unconstrained,
}


# ---- the parent -----------------------------------------------------------------------


def constrained_lengths(args: argparse.Namespace) -> list[int]:
    """Each request's output length under its schema (one untimed run)."""
    llm = make_llm(args)
    try:
        prompts = chat_prompts(llm, args.num_requests)
        outputs = llm.generate(prompts, constrained_params(args, args.num_requests))
    finally:
        llm.llm_engine.shutdown()
    return [len(output.outputs[0].token_ids) for output in outputs]


def compile_times(backend_name: str, repeats: int) -> list[float]:
    """Seconds from ``compile`` to the first filled mask, per schema and repeat."""
    from vlite.core.config import VliteConfig
    from vlite.core.plugins import PluginRegistry, build_plugin_manager
    from vlite.core.structured_output import allocate_bitmask
    from vlite.core.structured_output_params import StructuredOutputsParams
    from vlite.models.spec import ModelSpec

    spec = ModelSpec.from_config(VliteConfig())
    tokenizer = spec.load_tokenizer()
    registry = PluginRegistry(build_plugin_manager())
    backend_cls = registry.get("structured_output_backend", backend_name)
    times = []
    for _ in range(repeats):
        backend = backend_cls(tokenizer, spec.vocab_size)  # empty caches
        for _, schema in SCHEMAS:
            bitmask = allocate_bitmask(1, spec.vocab_size)
            start = time.perf_counter()
            compiled = backend.compile(StructuredOutputsParams(json=schema))
            compiled.new_matcher().fill_bitmask(bitmask, 0)
            times.append(time.perf_counter() - start)
    return times


def percentile(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(fraction * (len(ordered) - 1)))]


def report_compile_times(repeats: int) -> dict[str, dict[str, float]]:
    print(f"\ngrammar compile time, {len(SCHEMAS)} schemas x {repeats} repeats (fresh backends):")
    print("| backend | p50 ms | p99 ms | max ms |")
    print("| --- | ---: | ---: | ---: |")
    figures = {}
    for name in BACKENDS:
        times = [t * 1000 for t in compile_times(name, repeats)]
        figures[name] = {
            "p50_ms": statistics.median(times),
            "p99_ms": percentile(times, 0.99),
            "max_ms": max(times),
        }
        row = figures[name]
        print(f"| {name} | {row['p50_ms']:.2f} | {row['p99_ms']:.2f} | {row['max_ms']:.2f} |")
    return figures


def main() -> None:
    args = parse_args()
    if args.worker:
        harness.run_worker(args, WORKERS)
    harness.check_harness_options(args)
    lengths = constrained_lengths(args)
    print(f"constrained output lengths: {sum(lengths)} tokens over {len(lengths)} requests")
    common = ["--num-requests", str(args.num_requests), "--backend", args.backend]
    common += harness.setting_flags(args.vlite_setting)
    engines = [
        harness.Engine(harness.REFERENCE_ENGINE, harness.REFERENCE_ENGINE, ("--grammars", "warm")),
        harness.Engine(COLD, harness.REFERENCE_ENGINE, ("--grammars", "cold")),
        harness.Engine(UNCONSTRAINED, UNCONSTRAINED, ("--output-lens", json.dumps(lengths))),
    ]
    title = (
        f"Structured outputs on CPU: {args.num_requests} chat requests over {len(SCHEMAS)} JSON "
        f"schemas ({args.backend}) vs the same tokens unconstrained"
    )
    plan = harness.Plan(Path(__file__).resolve(), title, engines, common)
    harness.run_benchmark(plan, args)
    report_compile_times(args.compile_repeats)


if __name__ == "__main__":
    main()
