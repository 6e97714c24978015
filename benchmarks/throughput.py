"""Offline throughput: vlite vs transformers, static and continuous batching, alternated.

A mixed workload of ``--num-requests`` requests (prompt and output lengths drawn
uniformly from ``--prompt-len`` and ``--output-len`` with ``--seed``, random token ids,
``ignore_eos`` so every request produces exactly its output length) goes through

* ``vlite``: ``LLM.generate`` with vlite's defaults, ``--vlite-setting KEY=VALUE`` on top
  (and ``cpu_threads=N`` when vlite accepts it); each ``--vlite-variant
  NAME:KEY=VALUE,...`` adds one more vlite row;
* ``transformers-static``: ``transformers`` ``generate`` in static batches of
  ``--hf-batch-size`` requests (left-padded; a batch runs until its longest request is
  done; only the requested tokens count);
* ``transformers-compiled``: the same static batches through transformers' fast path on a
  GPU: a static KV cache (``StaticCache``, one for the whole run, sized for a full batch
  and the workload's longest prompt plus output) and the decode step compiled by
  ``torch.compile`` (transformers compiles it itself for a static cache on CUDA, mode
  ``reduce-overhead``: CUDA graphs). A short last batch is filled up with copies of its
  first prompt (not counted), so every batch has the compiled shape; the warm-up is one
  full batch, so compilation is not timed;
* ``transformers-continuous``: transformers' own continuous batching
  (``init_continuous_batching``, the engine behind ``generate_batch``), each request with
  its own ``max_new_tokens`` (the produced tokens are counted and checked).

Output tokens/s = the workload's output tokens / the wall time of the whole workload, in
each trial's fresh process after a warm-up on two other prompts (so vlite's prefix cache
cannot skip any timed prefill). The peers load the model as a Hugging Face folder (by
default the GGUF file dequantized to float32 and exported once into the temp dir) with
``--device`` and ``--dtype`` (float32 on CPU, bfloat16 on CUDA); vlite loads the model
itself (by default the GGUF file, kept quantized or not as its ``quantization`` setting
says; ``--vlite-variant vlite-fp32:quantization=none`` adds a dequantized row) and gets
``--device``/``--dtype`` only when given (its own default picks the same). Every trial
is a fresh subprocess with ``N`` threads; rounds alternate the engines and report best and
median (see ``harness.py`` for the rounds, the background load and the quiet check).

    python benchmarks/throughput.py                       # all cores, 32 requests, 3 rounds
    python benchmarks/throughput.py --threads 1 2 --background-load 0 1 --rounds 5 \\
        --json throughput.json --plot throughput.png
    python benchmarks/throughput.py --vlite-variant vlite-fp32:quantization=none
    python benchmarks/throughput.py --model path/to/hf-folder --num-requests 16
    python benchmarks/throughput.py --threads 1 --rounds 1 --quick --num-requests 4  # smoke
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import harness  # benchmarks/harness.py: run as a script, its folder is on sys.path

STATIC = "transformers-static"
COMPILED = "transformers-compiled"
CONTINUOUS = "transformers-continuous"
ENGINES = (harness.REFERENCE_ENGINE, STATIC, COMPILED, CONTINUOUS)
DEFAULT_ENGINES = (harness.REFERENCE_ENGINE, STATIC, CONTINUOUS)
COMPILED_WARM_UP_TOKENS = 8
WARM_UP_REQUESTS = 2


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=harness.HelpFormatter)
    parser.add_argument(
        "--model",
        help="Hugging Face folder or .gguf file; default: SmolLM2-135M-Instruct (vlite loads "
        "its GGUF file, the peers its float32 export)",
    )
    parser.add_argument(
        "--engines",
        nargs="+",
        choices=ENGINES,
        default=list(DEFAULT_ENGINES),
        help=f"engines to run, in this order ({COMPILED} is for a GPU, where transformers "
        "compiles the decode step for a static cache)",
    )
    parser.add_argument("--skip-continuous", action="store_true", help=f"leave {CONTINUOUS} out")
    parser.add_argument("--num-requests", type=int, default=32, help="requests in the workload")
    parser.add_argument(
        "--prompt-len",
        type=int,
        nargs=2,
        default=(16, 256),
        metavar=("MIN", "MAX"),
        help="prompt lengths in tokens, drawn uniformly",
    )
    parser.add_argument(
        "--output-len",
        type=int,
        nargs=2,
        default=(16, 128),
        metavar=("MIN", "MAX"),
        help="output lengths in tokens, drawn uniformly (forced)",
    )
    parser.add_argument(
        "--hf-batch-size", type=int, default=16, help=f"requests per batch of {STATIC}"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the workload")
    parser.add_argument("--device", help="default: cuda if available, else cpu")
    parser.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        help="default: float32 on CPU, bfloat16 on CUDA",
    )
    harness.add_vlite_options(parser)
    harness.add_harness_options(parser, default_threads=[harness.available_cores()])
    # Set by the parent for its trials' subprocesses.
    parser.add_argument("--hf-folder", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--vocab-size", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--peer-device", help=argparse.SUPPRESS)
    parser.add_argument("--peer-dtype", help=argparse.SUPPRESS)
    return parser.parse_args()


# ---- the workload -----------------------------------------------------------------------


def make_workload(args: argparse.Namespace, seed: int, num_requests: int) -> Workload:
    rng = random.Random(seed)
    prompts = [
        [rng.randrange(100, args.vocab_size) for _ in range(rng.randint(*args.prompt_len))]
        for _ in range(num_requests)
    ]
    output_lens = [rng.randint(*args.output_len) for _ in range(num_requests)]
    return Workload(prompts, output_lens)


def timed_and_warm_up(args: argparse.Namespace) -> tuple[Workload, Workload]:
    """The timed workload (from ``--seed``) and a two-request warm-up on other prompts."""
    return (
        make_workload(args, args.seed, args.num_requests),
        make_workload(args, args.seed + 1, WARM_UP_REQUESTS),
    )


# ---- workers (each in its trial's subprocess) -------------------------------------------


def run_vlite(args: argparse.Namespace) -> dict[str, Any]:
    from vlite import SamplingParams

    workload, warm_up = timed_and_warm_up(args)
    settings = harness.parse_settings(args.vlite_setting)
    llm, took_cpu_threads = harness.make_vlite_llm(args.model, settings, args.threads[0])

    def generate(work: Workload) -> int:
        params = [
            SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in work.output_lens
        ]
        prompts = [{"prompt_token_ids": p} for p in work.prompts]
        outputs = llm.generate(prompts, params, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outputs)

    generate(warm_up)
    start = time.perf_counter()
    produced = generate(workload)
    seconds = time.perf_counter() - start
    harness.check_token_count("vlite", produced, workload.num_output_tokens)
    return {
        "seconds": seconds,
        "output_tokens": produced,
        "settings": settings,
        "cpu_threads_setting": took_cpu_threads,
    }


def load_hf_model(args: argparse.Namespace) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    dtype = getattr(torch, args.peer_dtype)
    model = AutoModelForCausalLM.from_pretrained(args.hf_folder, dtype=dtype)
    return model.to(args.peer_device).eval()


def run_hf_static(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    workload, warm_up = timed_and_warm_up(args)
    model = load_hf_model(args)
    model.generation_config.eos_token_id = None
    pad_id = model.config.pad_token_id or 0

    def generate(work: Workload) -> int:
        """Every batch to its longest output; the padding tokens it also generated."""
        padding = 0
        for batch, lens in static_batches(work, args.hf_batch_size):
            input_ids, attention_mask = (t.to(args.peer_device) for t in left_pad(batch, pad_id))
            with torch.inference_mode():
                output = model.generate(
                    input_ids=input_ids,
                    attention_mask=attention_mask,
                    max_new_tokens=max(lens),
                    do_sample=False,
                    pad_token_id=pad_id,
                )
            harness.check_token_count(STATIC, output.shape[1] - input_ids.shape[1], max(lens))
            padding += sum(max(lens) - n for n in lens)
        return padding

    generate(warm_up)
    start = time.perf_counter()
    padding = generate(workload)
    seconds = time.perf_counter() - start
    return {
        "seconds": seconds,
        "output_tokens": workload.num_output_tokens,
        "tokens_beyond_request_lengths": padding,
        "batch_size": args.hf_batch_size,
        "device": args.peer_device,
        "dtype": args.peer_dtype,
    }


def run_hf_compiled(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from transformers import StaticCache

    workload, _ = timed_and_warm_up(args)
    model = load_hf_model(args)
    model.generation_config.eos_token_id = None
    pad_id = model.config.pad_token_id or 0
    batch_size = min(args.hf_batch_size, len(workload.prompts))
    cache_len = max(map(len, workload.prompts)) + max(workload.output_lens)
    cache = StaticCache(config=model.config, max_cache_len=cache_len)

    def generate_batch(batch: list[list[int]], new_tokens: int) -> None:
        filled = batch + [batch[0]] * (batch_size - len(batch))
        input_ids, attention_mask = (t.to(args.peer_device) for t in left_pad(filled, pad_id))
        with torch.inference_mode():
            cache.reset()
            output = model.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                past_key_values=cache,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
                pad_token_id=pad_id,
            )
        harness.check_token_count(COMPILED, output.shape[1] - input_ids.shape[1], new_tokens)

    warm_up = make_workload(args, args.seed + 1, batch_size)
    generate_batch(warm_up.prompts, COMPILED_WARM_UP_TOKENS)
    padding = 0
    start = time.perf_counter()
    for batch, lens in static_batches(workload, batch_size):
        generate_batch(batch, max(lens))
        padding += sum(max(lens) - n for n in lens)
    seconds = time.perf_counter() - start
    return {
        "seconds": seconds,
        "output_tokens": workload.num_output_tokens,
        "tokens_beyond_request_lengths": padding,
        "batch_size": batch_size,
        "static_cache_len": cache_len,
        "decode_step_compiled": getattr(model, "_compiled_call", None) is not None,
        "device": args.peer_device,
        "dtype": args.peer_dtype,
    }


def static_batches(work: Workload, size: int) -> Iterator[tuple[list[list[int]], list[int]]]:
    """The workload's requests ``size`` at a time, in order: (prompts, output lengths)."""
    for first in range(0, len(work.prompts), size):
        yield work.prompts[first : first + size], work.output_lens[first : first + size]


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[Any, Any]:
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    return ids, mask


def run_hf_continuous(args: argparse.Namespace) -> dict[str, Any]:
    from transformers import GenerationConfig

    workload, warm_up = timed_and_warm_up(args)
    model = load_hf_model(args)
    config = GenerationConfig(
        do_sample=False, eos_token_id=None, max_new_tokens=max(workload.output_lens)
    )
    manager = model.init_continuous_batching(generation_config=config)
    manager.start()
    try:
        run_continuous(manager, warm_up)
        start = time.perf_counter()
        produced = run_continuous(manager, workload)
        seconds = time.perf_counter() - start
    finally:
        manager.stop(block=True)
    harness.check_token_count(CONTINUOUS, produced, workload.num_output_tokens)
    return {
        "seconds": seconds,
        "output_tokens": produced,
        "device": args.peer_device,
        "dtype": args.peer_dtype,
    }


def run_continuous(manager: Any, work: Workload) -> int:
    """Submit every request at once and wait for all; the tokens they produced."""
    request_ids = [
        manager.add_request(prompt, max_new_tokens=n)
        for prompt, n in zip(work.prompts, work.output_lens)
    ]
    produced: dict[str, int] = {}
    while len(produced) < len(request_ids):
        result = manager.get_result(timeout=600)
        if result is None:
            raise RuntimeError("transformers continuous batching produced no result in 600 s")
        if result.error:
            raise RuntimeError(f"transformers continuous batching: {result.error}")
        if result.is_finished():
            produced[result.request_id] = len(result.generated_tokens)
    return sum(produced.values())


WORKERS: dict[str, harness.WorkerFunction] = {
    harness.REFERENCE_ENGINE: run_vlite,
    STATIC: run_hf_static,
    COMPILED: run_hf_compiled,
    CONTINUOUS: run_hf_continuous,
}


# ---- the parent -------------------------------------------------------------------------


def engines_to_run(args: argparse.Namespace) -> list[harness.Engine]:
    names = [n for n in args.engines if not (args.skip_continuous and n == CONTINUOUS)]
    return harness.engines_for(names, args)


def peer_folder(model: str | None) -> Path:
    """The Hugging Face folder the transformers engines load."""
    if model is None:
        return harness.default_model_folder()
    path = Path(model)
    if path.suffix == ".gguf":
        return harness.hf_folder_for_gguf(path)
    if not (path / "config.json").is_file():
        raise SystemExit(f"--model {model}: not a .gguf file nor a Hugging Face folder")
    return path


def device_and_dtype(args: argparse.Namespace) -> tuple[str, str]:
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    return device, args.dtype or ("bfloat16" if device == "cuda" else "float32")


def vlite_device_settings(args: argparse.Namespace) -> list[str]:
    """``--device``/``--dtype`` as vlite settings, when given and not set otherwise."""
    explicit = harness.parse_settings(args.vlite_setting)
    given = {"device": args.device, "dtype": args.dtype}
    return [f"{k}={v}" for k, v in given.items() if v is not None and k not in explicit]


def main() -> None:
    args = parse_args()
    if args.worker:
        harness.run_worker(args, WORKERS)
    harness.check_harness_options(args)
    args.vlite_setting = vlite_device_settings(args) + args.vlite_setting
    engines = engines_to_run(args)
    if not engines:
        raise SystemExit("no engine to run")
    device, dtype = device_and_dtype(args)
    has_peers = any(e.worker != harness.REFERENCE_ENGINE for e in engines)
    folder = peer_folder(args.model) if has_peers else None
    vocab_source = folder or (Path(args.model) if args.model else harness.default_gguf_path())
    args.vocab_size = harness.vocab_size(vocab_source)
    workload = make_workload(args, args.seed, args.num_requests)
    worker_args = [
        "--vocab-size",
        str(args.vocab_size),
        "--num-requests",
        str(args.num_requests),
        "--prompt-len",
        *map(str, args.prompt_len),
        "--output-len",
        *map(str, args.output_len),
        "--seed",
        str(args.seed),
        "--hf-batch-size",
        str(args.hf_batch_size),
        "--peer-device",
        device,
        "--peer-dtype",
        dtype,
    ]
    if args.model:
        worker_args += ["--model", args.model]
    if folder:
        worker_args += ["--hf-folder", str(folder)]
    title = (
        f"offline throughput: {Path(args.model).name if args.model else 'SmolLM2-135M-Instruct'}"
        f", {args.num_requests} requests, prompts {args.prompt_len[0]}-{args.prompt_len[1]}, "
        f"outputs {args.output_len[0]}-{args.output_len[1]} tokens "
        f"({workload.num_output_tokens} in all), greedy, end of sequence ignored; "
        f"peers on {device} in {dtype}"
    )
    settings = {
        "model": args.model,
        "peer_folder": str(folder) if folder else None,
        "num_requests": args.num_requests,
        "prompt_len": list(args.prompt_len),
        "output_len": list(args.output_len),
        "output_tokens": workload.num_output_tokens,
        "seed": args.seed,
        "hf_batch_size": args.hf_batch_size,
        "peer_device": device,
        "peer_dtype": dtype,
    }
    harness.run_benchmark(
        harness.Plan(Path(__file__).resolve(), title, engines, worker_args, settings), args
    )


if __name__ == "__main__":
    main()
