"""Scheduling policies on CPU, each measured against its peer in the same run.

(a) chunked prefill: decodes keep running while long prompts arrive; p99 inter-token
    latency and throughput of ``chunked-prefill`` vs ``fcfs`` (targets: >= 2x lower p99
    ITL at >= 0.9x the throughput).
(b) priority: urgent requests arrive into a loaded engine; their TTFT with ``priority``
    vs ``fcfs``.
(c) prefix caching: requests sharing a long prefix, TTFT with caching on vs off (target
    >= 3x lower); throughput on distinct prompts (0% hits), on vs off (target >= 0.98x).

Arrivals are placed at engine steps (not wall-clock times), so both sides of a comparison
see the same workload. Each side is one engine, built and warmed once; the sides then run
the workload in alternating rounds (A B, A B, ...; ``--rounds``, default 3), and every
figure is the best and the median of the rounds (ratios: of the medians, then of the
bests). Default: a small random Llama (hidden 256, 4 layers, 2048 positions) so the run
takes a few minutes; ``--model`` takes a Hugging Face folder.

    python benchmarks/scheduling.py
    python benchmarks/scheduling.py --model path/to/hf-folder --threads 8
"""

from __future__ import annotations

import argparse
import functools
import random
import statistics
import tempfile
import timeit
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch

from vlite import LLM
from vlite.bench.percentiles import percentile
from vlite.bench.workload import Arrival, random_token_ids, run_workload

T = TypeVar("T")
W = TypeVar("W")


def random_tokens(rng: random.Random, n: int) -> list[int]:
    return random_token_ids(rng, n, vocab_size=300)


def warm_up(llm: LLM) -> None:
    run_workload(llm.llm_engine, [Arrival(0, "warm", list(range(4, 68)), 4)])


def alternate(sides: dict[str, Callable[[W], T]], workloads: list[W]) -> dict[str, list[T]]:
    """Each side's result for each round's workload, the sides alternating within a round.

    Every round gets a workload of its own (fresh random prompts), so no round finds the
    previous one's prompts in a side's prefix cache.
    """
    results: dict[str, list[T]] = {name: [] for name in sides}
    for workload in workloads:
        for name, run in sides.items():
            results[name].append(run(workload))
    return results


def best_and_median(values: list[float], lower_is_better: bool) -> tuple[float, float]:
    best = min(values) if lower_is_better else max(values)
    return best, statistics.median(values)


def describe(values: list[float], scale: float, lower_is_better: bool) -> str:
    best, median = best_and_median(values, lower_is_better)
    return f"{best * scale:7.1f} / {median * scale:7.1f}"


def ratio(numerator: list[float], denominator: list[float], lower_is_better: bool) -> str:
    """median/median (best/best) of two sides' figures."""
    top_best, top_median = best_and_median(numerator, lower_is_better)
    bottom_best, bottom_median = best_and_median(denominator, lower_is_better)
    return f"{top_median / bottom_median:.2f}x ({top_best / bottom_best:.2f}x best)"


# ---- (a) chunked prefill ----------------------------------------------------------------


def chunked_prefill_arrivals(args, seed: int) -> list[Arrival]:
    rng = random.Random(seed)
    arrivals = [
        Arrival(0, f"decode-{i}", random_tokens(rng, 16), args.decode_tokens)
        for i in range(args.num_decodes)
    ]
    for index in range(args.num_long_prompts):
        at = 4 + index * args.long_prompt_every
        arrivals.append(Arrival(at, f"long-{index}", random_tokens(rng, args.long_prompt_len), 8))
    return arrivals


def chunked_prefill_case(args, model: str) -> None:
    sides = {}
    for scheduler, budget in (("fcfs", 2048), ("chunked-prefill", args.chunk_budget)):
        llm = LLM(model=model, scheduler=scheduler, max_num_batched_tokens=budget, seed=0)
        warm_up(llm)
        sides[scheduler] = functools.partial(run_workload, llm.llm_engine)
    workloads = [chunked_prefill_arrivals(args, args.seed + 10 * r) for r in range(args.rounds)]
    results = alternate(sides, workloads)

    def p99_itls(name: str) -> list[float]:
        return [percentile(r.all_token_gaps_s("decode"), 99) for r in results[name]]

    def throughputs(name: str) -> list[float]:
        return [r.output_tokens_per_s for r in results[name]]

    print(
        f"(a) chunked prefill: {args.num_decodes} decodes x {args.decode_tokens} tokens, "
        f"{args.num_long_prompts} prompts of {args.long_prompt_len} tokens arriving; "
        f"chunk budget {args.chunk_budget}; best / median of {args.rounds} rounds"
    )
    for name in results:
        print(
            f"    {name:16s} p99 ITL {describe(p99_itls(name), 1e3, True)} ms   "
            f"{describe(throughputs(name), 1, False)} output tok/s"
        )
    print(
        f"    p99 ITL fcfs / chunked = {ratio(p99_itls('fcfs'), p99_itls('chunked-prefill'), True)}"
        f" (target >= 2)   throughput chunked / fcfs = "
        f"{ratio(throughputs('chunked-prefill'), throughputs('fcfs'), False)} (target >= 0.9)"
    )


# ---- (b) priority -----------------------------------------------------------------------


def priority_arrivals(args, seed: int) -> list[Arrival]:
    rng = random.Random(seed)
    arrivals = [
        Arrival(0, f"bg-{i}", random_tokens(rng, rng.randint(32, 128)), 32, priority=1)
        for i in range(args.num_background)
    ]
    arrivals += [
        Arrival(8 + 12 * i, f"urgent-{i}", random_tokens(rng, 24), 8, priority=0)
        for i in range(args.num_urgent)
    ]
    return arrivals


def priority_case(args, model: str) -> None:
    def mean_urgent_ttft(llm: LLM, arrivals: list[Arrival]) -> float:
        result = run_workload(llm.llm_engine, arrivals)
        urgent = [t for rid, t in result.ttft_s.items() if rid.startswith("urgent")]
        return sum(urgent) / len(urgent)

    sides = {}
    for scheduler in ("fcfs", "priority"):
        llm = LLM(model=model, scheduler=scheduler, max_num_seqs=args.max_num_seqs, seed=0)
        warm_up(llm)
        sides[scheduler] = functools.partial(mean_urgent_ttft, llm)
    workloads = [priority_arrivals(args, args.seed + 1 + 10 * r) for r in range(args.rounds)]
    ttft = alternate(sides, workloads)
    print(
        f"(b) priority: {args.num_urgent} urgent requests into {args.num_background} queued "
        f"ones, max_num_seqs={args.max_num_seqs}; best / median of {args.rounds} rounds"
    )
    for name, values in ttft.items():
        print(f"    {name:16s} mean urgent TTFT {describe(values, 1e3, True)} ms")
    print(f"    urgent TTFT fcfs / priority = {ratio(ttft['fcfs'], ttft['priority'], True)}")


# ---- (c) prefix caching -----------------------------------------------------------------


def prefix_caching_arrivals(args, seed: int) -> tuple[list[Arrival], list[Arrival]]:
    """Requests sharing a prefix, and distinct ones (no prefix hits)."""
    rng = random.Random(seed)
    prefix = random_tokens(rng, args.shared_prefix_len)
    shared = [
        Arrival(i * 12, f"shared-{i}", prefix + random_tokens(rng, 16), 8)
        for i in range(args.num_shared)
    ]
    distinct = [
        Arrival(0, f"distinct-{i}", random_tokens(rng, rng.randint(64, 256)), 32)
        for i in range(args.num_distinct)
    ]
    return shared, distinct


def prefix_caching_case(args, model: str) -> None:
    def run_both(llm: LLM, workload: tuple[list[Arrival], list[Arrival]]) -> tuple[float, float]:
        """(mean TTFT of the shared requests after the first, 0%-hit throughput)."""
        shared, distinct = workload
        result = run_workload(llm.llm_engine, shared)
        later = [t for rid, t in result.ttft_s.items() if rid != "shared-0"]
        throughput = run_workload(llm.llm_engine, distinct).output_tokens_per_s
        return sum(later) / len(later), throughput

    sides = {}
    for caching in ("on", "off"):
        llm = LLM(model=model, enable_prefix_caching=caching == "on", seed=0)
        warm_up(llm)
        sides[caching] = functools.partial(run_both, llm)
    workloads = [prefix_caching_arrivals(args, args.seed + 2 + 10 * r) for r in range(args.rounds)]
    results = alternate(sides, workloads)
    ttft = {name: [r[0] for r in runs] for name, runs in results.items()}
    throughput = {name: [r[1] for r in runs] for name, runs in results.items()}
    print(
        f"(c) prefix caching: {args.num_shared} requests sharing a {args.shared_prefix_len}-"
        f"token prefix, one at a time; {args.num_distinct} distinct prompts; best / median "
        f"of {args.rounds} rounds"
    )
    for name in results:
        print(
            f"    caching {name:3s}      mean TTFT (after the first) "
            f"{describe(ttft[name], 1e3, True)} ms   0%-hit "
            f"{describe(throughput[name], 1, False)} output tok/s"
        )
    print(
        f"    TTFT off / on = {ratio(ttft['off'], ttft['on'], True)} (target >= 3)   "
        f"0%-hit throughput on / off = {ratio(throughput['on'], throughput['off'], False)} "
        "(target >= 0.98)"
    )
    sha256_us, builtin_us = block_key_cost_us(block_size=16)
    prompt_us = sha256_us * args.shared_prefix_len / 16
    print(
        f"    block key: chained sha256 {sha256_us:.2f} us per 16-token block "
        f"(Python's 64-bit hash() of the same tuple: {builtin_us:.2f} us); a "
        f"{args.shared_prefix_len}-token prompt's keys: {prompt_us:.0f} us"
    )


def block_key_cost_us(
    block_size: int, num_blocks: int = 2000, rounds: int = 5
) -> tuple[float, float]:
    """Best-of-``rounds`` microseconds per block: the cache's chained sha256 key, and the
    64-bit ``hash((parent, tokens))`` it replaced."""
    from vlite.core.kv_cache import hash_block_tokens

    rng = random.Random(0)
    blocks = [random_tokens(rng, block_size) for _ in range(num_blocks)]

    def sha256_chain() -> None:
        parent = None
        for tokens in blocks:
            parent = hash_block_tokens(parent, tokens)

    def builtin_chain() -> None:
        parent = None
        for tokens in blocks:
            parent = hash((parent, tuple(tokens)))

    return tuple(
        min(timeit.timeit(chain, number=1) for _ in range(rounds)) / num_blocks * 1e6
        for chain in (sha256_chain, builtin_chain)
    )


def default_model(folder: Path) -> str:
    from vlite.testing.tiny_models import make_tiny_model

    return str(
        make_tiny_model(
            folder,
            "LlamaForCausalLM",
            hidden_size=256,
            intermediate_size=768,
            num_hidden_layers=4,
            num_attention_heads=8,
            num_kv_heads=4,
            max_position_embeddings=2048,
        )
    )


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="Hugging Face folder; default: a small random Llama")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds per case")
    parser.add_argument("--cases", default="abc", help="which of a, b, c to run")
    parser.add_argument("--num-decodes", type=int, default=8)
    parser.add_argument("--decode-tokens", type=int, default=96)
    parser.add_argument("--num-long-prompts", type=int, default=6)
    parser.add_argument("--long-prompt-len", type=int, default=1000)
    parser.add_argument("--long-prompt-every", type=int, default=14, help="steps")
    parser.add_argument("--chunk-budget", type=int, default=128)
    parser.add_argument("--num-background", type=int, default=24)
    parser.add_argument("--num-urgent", type=int, default=6)
    parser.add_argument("--max-num-seqs", type=int, default=4)
    parser.add_argument("--shared-prefix-len", type=int, default=1024)
    parser.add_argument("--num-shared", type=int, default=8)
    parser.add_argument("--num-distinct", type=int, default=16)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or default_model(Path(tmp) / "model")
        print(
            f"model {args.model or 'random Llama (hidden 256, 4 layers)'}, CPU, "
            f"{args.threads} threads"
        )
        cases = {"a": chunked_prefill_case, "b": priority_case, "c": prefix_caching_case}
        for letter in args.cases:
            cases[letter](args, model)


if __name__ == "__main__":
    main()
