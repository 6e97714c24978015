"""Decode speed on a GPU with CUDA graphs and without, alternated in one process.

One engine per mode of :data:`MODES` is built side by side, each with ``--kv-cache-gib`` of
cache (their greedy tokens are checked first: the graphed modes must agree); every round
runs each batch size on each engine in turn (A B C A B C ...): ``B`` requests of
``--input-len`` random prompt tokens arriving together, each decoding exactly
``--output-len`` tokens. The decode step time is the median gap
between a request's consecutive tokens (every step of the run after the prefill is a
decode of all ``B``), so decode tokens/s is ``B`` over it. Batch 1 is also set against the
memory roofline: the weights' bytes read once per step at ``--peak-gbps`` (by default the
datasheet bandwidth of the GPU found, see :data:`PEAK_GBPS`).

    python benchmarks/random_model.py llama-1b /tmp/llama-1b --config-only
    python benchmarks/decode_graphs.py --model /tmp/llama-1b --batch-sizes 1 64 256 \
        --json decode.json --plot decode.png
    python benchmarks/decode_graphs.py --replot decode.json --plot decode.png  # redraw
"""

from __future__ import annotations

import argparse
import json
import random
import statistics

import torch

from vlite import LLM, SamplingParams
from vlite.bench.workload import Arrival, random_token_ids, run_workload

#: Engine settings per mode: graphs with async scheduling (the next batch launched before
#: this one's tokens reach the host), graphs alone, and neither (every step eager).
MODES = {
    "graphs+async": {"async_scheduling": True},
    "graphs": {"async_scheduling": False},
    "eager": {"enforce_eager": True, "async_scheduling": False},
}

#: Datasheet HBM bandwidth in GB/s by a substring of ``torch.cuda.get_device_name()``,
#: most specific first (an H100 PCIe has less than the SXM part).
PEAK_GBPS = {"H100 PCIe": 2039.0, "H100": 3352.0, "H200": 4800.0, "A100": 2039.0}


def datasheet_peak_gbps() -> float:
    """The :data:`PEAK_GBPS` entry of this process's GPU; refuses a GPU it does not know."""
    name = torch.cuda.get_device_name()
    for part, gbps in PEAK_GBPS.items():
        if part in name:
            return gbps
    raise SystemExit(f"no memory bandwidth known for {name!r}: give --peak-gbps")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="model folder (config.json suffices)")
    parser.add_argument("--load-format", default="dummy", help="vlite's load_format")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--kv-cache-gib", type=float, default=8.0)
    parser.add_argument(
        "--peak-gbps",
        type=float,
        help="the GPU's memory bandwidth in GB/s (default: its datasheet figure, "
        f"known for {', '.join(PEAK_GBPS)})",
    )
    parser.add_argument("--modes", nargs="+", choices=sorted(MODES), default=list(MODES))
    parser.add_argument("--json", help="write every measurement here")
    parser.add_argument("--plot", help="draw decode tokens/s per batch size and mode here")
    parser.add_argument(
        "--replot", metavar="JSON", help="only draw --plot from an earlier run's --json"
    )
    parser.add_argument("--title", help="the chart's title (default: the device and model)")
    return parser.parse_args()


def decode_step_s(llm: LLM, batch: int, args: argparse.Namespace, seed: int) -> float:
    """The median inter-token gap of ``batch`` requests decoding together."""
    rng = random.Random(seed)
    vocab = llm.llm_engine.model_spec.vocab_size
    arrivals = [
        Arrival(0, f"r{seed}-{i}", random_token_ids(rng, args.input_len, vocab), args.output_len)
        for i in range(batch)
    ]
    result = run_workload(llm.llm_engine, arrivals)
    return statistics.median(result.all_token_gaps_s())


def check_same_tokens(engines: dict[str, LLM]) -> None:
    """Greedy tokens of the modes that run the same kernels (with graphs) must be equal."""
    rng = random.Random(0)
    graphed = {mode: llm for mode, llm in engines.items() if mode != "eager"}
    if len(graphed) < 2:
        return
    vocab = next(iter(graphed.values())).llm_engine.model_spec.vocab_size
    prompts = [{"prompt_token_ids": random_token_ids(rng, 20 + 9 * i, vocab)} for i in range(6)]
    params = [
        SamplingParams(max_tokens=8 + 4 * i, temperature=0.0, ignore_eos=True) for i in range(6)
    ]
    tokens = {
        mode: [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        for mode, llm in graphed.items()
    }
    same = len({repr(t) for t in tokens.values()}) == 1
    print(f"greedy tokens equal across {', '.join(graphed)}: {same}", flush=True)


def plot(steps: dict[tuple[str, int], list[float]], path: str, title: str) -> None:
    """Median decode tokens/s per batch size, one bar per mode (best as a tick)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(dict.fromkeys(mode for mode, _ in steps))
    batches = sorted({batch for _, batch in steps})
    figure, axes = plt.subplots(figsize=(7, 3.6))
    width = 0.8 / len(modes)
    for index, mode in enumerate(modes):
        xs = [b + (index - (len(modes) - 1) / 2) * width for b in range(len(batches))]
        medians = [batch / statistics.median(steps[mode, batch]) for batch in batches]
        bests = [batch / min(steps[mode, batch]) for batch in batches]
        axes.bar(xs, medians, width, label=mode)
        axes.scatter(xs, bests, marker="_", color="black", zorder=3)
        for x, value in zip(xs, medians):
            axes.annotate(f"{value:,.0f}", (x, value), ha="center", va="bottom", fontsize=7)
    axes.set_xticks(range(len(batches)), [f"batch {b}" for b in batches])
    axes.set_yscale("log")
    axes.set_ylabel("decode tokens/s (median; tick: best)")
    axes.set_title(title, fontsize=9)
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    print(f"wrote {path}")


def read_steps(path: str) -> dict[tuple[str, int], list[float]]:
    with open(path) as source:
        raw = json.load(source)
    return {(key.rsplit("-", 1)[0], int(key.rsplit("-", 1)[1])): v for key, v in raw.items()}


def main() -> None:
    args = parse_args()
    if args.replot:
        plot(read_steps(args.replot), args.plot, args.title or "decode tokens/s by mode")
        return
    if args.model is None:
        raise SystemExit("--model is required (or --replot JSON --plot PNG)")
    peak_gbps = args.peak_gbps or datasheet_peak_gbps()
    engines = {
        mode: LLM(
            model=args.model,
            load_format=args.load_format,
            kv_cache_memory_gib=args.kv_cache_gib,
            max_num_seqs=max(args.batch_sizes),
            **MODES[mode],
        )
        for mode in args.modes
    }
    weights = next(iter(engines.values())).llm_engine.memory_plan.weights_bytes
    check_same_tokens(engines)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU (no graphs)"
    print(f"device: {device}, torch {torch.__version__}", flush=True)
    for llm in engines.values():  # warm-up: compile every kernel the runs use
        for batch in args.batch_sizes:
            decode_step_s(llm, batch, argparse.Namespace(**{**vars(args), "output_len": 4}), 0)
    steps: dict[tuple[str, int], list[float]] = {}
    for round_index in range(args.rounds):
        for batch in args.batch_sizes:
            for mode, llm in engines.items():
                step = decode_step_s(llm, batch, args, seed=1 + round_index)
                steps.setdefault((mode, batch), []).append(step)
                print(
                    f"round {round_index + 1} {mode:6s} batch {batch:4d}: {step * 1e3:.3f} ms/step",
                    flush=True,
                )
    roofline_s = weights / (peak_gbps * 1e9)
    print(
        f"\nweights {weights / 1e9:.2f} GB; roofline at {peak_gbps:,.0f} GB/s "
        f"{roofline_s * 1e3:.3f} ms per step"
    )
    print("| batch | mode | ms/step best | median | decode tok/s best | median | of roofline |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    for batch in args.batch_sizes:
        for mode in engines:
            best, median = min(steps[mode, batch]), statistics.median(steps[mode, batch])
            print(
                f"| {batch} | {mode} | {best * 1e3:.2f} | {median * 1e3:.2f} | "
                f"{batch / best:,.0f} | {batch / median:,.0f} | {roofline_s / best:.0%} |"
            )
    if args.json:
        with open(args.json, "w") as out:
            json.dump({f"{m}-{b}": v for (m, b), v in steps.items()}, out, indent=1)
    if args.plot:
        title = args.title or f"{device}: {args.model}, {args.input_len}-token prompts"
        plot(steps, args.plot, title)


if __name__ == "__main__":
    main()
