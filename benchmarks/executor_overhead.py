"""Per-step overhead of the executors: decode steps of a tiny random Llama, timed one by one.

The model (vlite's tiny test Llama: hidden 64, 2 layers, float32) computes almost nothing,
so a step's time is the engine's own work plus what the executor adds to hand the step to
its workers and bring the tokens back. Every executor runs the same requests: ``--batch``
prompts of 8 tokens, ``--steps`` greedy decode steps each (end of sequence ignored); the
prefill step is not timed. Engines are built once per tensor-parallel size and kept; each
round times every executor once, in the same order (A B A B ...), so a drift in the
machine's speed touches all alike; the table gives each executor's best and median (over
rounds) of the mean decode-step time, and what it adds to ``uniproc``'s (tp=1 only).

The ``ray`` executor connects to a local Ray instance this script starts first (its start
is not timed); it needs ``pip install "vlite[ray]"``.

    python benchmarks/executor_overhead.py                      # tp 1 and 2, 5 rounds
    python benchmarks/executor_overhead.py --tp 2 --steps 500 --rounds 3 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

MIN_ROUNDS = 3
PROMPT_LEN = 8


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2], help="tensor-parallel sizes")
    parser.add_argument(
        "--executors", nargs="+", default=["multiproc", "ray"], help="executors to compare"
    )
    parser.add_argument("--steps", type=int, default=200, help="timed decode steps per round")
    parser.add_argument("--batch", type=int, default=1, help="requests in every step")
    parser.add_argument("--rounds", type=int, default=5, help=f"rounds (at least {MIN_ROUNDS})")
    parser.add_argument("--cpu-threads", type=int, default=1, help="threads per worker")
    parser.add_argument("--json", type=Path, help="write every round's numbers here")
    args = parser.parse_args()
    if args.rounds < MIN_ROUNDS:
        parser.error(f"--rounds {args.rounds}: at least {MIN_ROUNDS} are needed for a median")
    return args


def build_engine(model: Path, executor: str, tp: int, cpu_threads: int):
    from vlite import LLM

    return LLM(
        model=str(model),
        executor=executor,
        tensor_parallel_size=tp,
        cpu_threads=cpu_threads,
        enable_prefix_caching=False,
        num_kv_blocks=256,
    )


def mean_decode_step_ms(llm, steps: int, batch: int) -> float:
    """Run ``batch`` requests for ``steps`` decode steps; the mean decode step, in ms."""
    from vlite import SamplingParams

    engine = llm.llm_engine
    params = SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True)
    for index in range(batch):
        prompt = [10 + (index + offset) % 200 for offset in range(PROMPT_LEN)]
        engine.add_request(engine.new_request_id(), {"prompt_token_ids": prompt}, params)
    engine.step()  # the prefill (and first token): not timed
    durations = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        durations.append(time.perf_counter() - start)
    return 1000 * statistics.fmean(durations)


def measure(args: argparse.Namespace, model: Path) -> dict[int, dict[str, list[float]]]:
    """``{tp: {executor: [mean step ms of each round]}}``."""
    results: dict[int, dict[str, list[float]]] = {}
    for tp in args.tp:
        executors = (["uniproc"] if tp == 1 else []) + list(args.executors)
        engines = {name: build_engine(model, name, tp, args.cpu_threads) for name in executors}
        try:
            for llm in engines.values():  # warm-up
                mean_decode_step_ms(llm, min(args.steps, 20), args.batch)
            rounds: dict[str, list[float]] = {name: [] for name in executors}
            for _ in range(args.rounds):
                for name, llm in engines.items():
                    rounds[name].append(mean_decode_step_ms(llm, args.steps, args.batch))
            results[tp] = rounds
        finally:
            for llm in engines.values():
                llm.llm_engine.shutdown()
    return results


def print_table(results: dict[int, dict[str, list[float]]]) -> None:
    print("| tp | executor | best ms/step | median ms/step | vs uniproc (median) |")
    print("|---:|---|---:|---:|---:|")
    for tp, rounds in results.items():
        baseline = statistics.median(rounds["uniproc"]) if "uniproc" in rounds else None
        for name, values in rounds.items():
            median = statistics.median(values)
            added = "" if baseline is None else f"{median - baseline:+.3f} ms"
            print(f"| {tp} | {name} | {min(values):.3f} | {median:.3f} | {added} |")


def main() -> None:
    args = parse_args()
    print(f"load average (1 min) before: {os.getloadavg()[0]:.2f}; cores: {os.cpu_count()}")
    if "ray" in args.executors:
        import ray

        ray.init(include_dashboard=False, object_store_memory=100 << 20, log_to_driver=False)
    from vlite.testing.tiny_models import make_tiny_model

    with tempfile.TemporaryDirectory(prefix="vlite-overhead-") as folder:
        model = make_tiny_model(Path(folder) / "llama", "LlamaForCausalLM")
        results = measure(args, model)
    print(f"load average (1 min) after: {os.getloadavg()[0]:.2f}")
    print(f"{args.steps} decode steps of {args.batch} request(s), {args.rounds} rounds")
    print_table(results)
    if args.json:
        args.json.write_text(json.dumps({str(tp): r for tp, r in results.items()}, indent=2))


if __name__ == "__main__":
    main()
