"""A mixture of experts against a dense model with the same active parameters, on CPU.

Builds two random models with the same attention and depth: a Mixtral with ``--experts``
experts of ``--expert-size`` features, ``--top-k`` per token, and a Llama whose MLP has
``top_k * expert_size`` features — the parameters one token passes through are the same,
the MoE holds ``experts / top_k`` times more MLP weights. Runs the same batch of requests on
each, alternating (A B, A B, ...) over ``--rounds`` rounds, and prints output tokens/s
(best and median) and their ratio.

    python benchmarks/moe.py
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from vlite import LLM, SamplingParams
from vlite.testing.tiny_models import make_tiny_model


def build_models(args, root: Path) -> dict[str, str]:
    common = dict(
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=8,
        num_kv_heads=4,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
    )
    moe = make_tiny_model(
        root / "moe",
        "MixtralForCausalLM",
        intermediate_size=args.expert_size,
        num_local_experts=args.experts,
        num_experts_per_tok=args.top_k,
        **common,
    )
    dense_size = args.top_k * args.expert_size
    dense = make_tiny_model(
        root / "dense", "LlamaForCausalLM", intermediate_size=dense_size, **common
    )
    return {"moe": str(moe), "dense": str(dense)}


def run(llm: LLM, prompts: list[dict], params: SamplingParams) -> float:
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--expert-size", type=int, default=768)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    generator = torch.Generator().manual_seed(0)
    prompts = [
        {"prompt_token_ids": torch.randint(4, 300, (args.prompt_len,), generator=g).tolist()}
        for g in [generator] * args.requests
    ]
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    with tempfile.TemporaryDirectory() as root:
        folders = build_models(args, Path(root))
        engines = {name: LLM(model=folder, seed=0) for name, folder in folders.items()}
        for llm in engines.values():
            run(llm, prompts[:2], params)  # warm up
        results: dict[str, list[float]] = {name: [] for name in engines}
        for _ in range(args.rounds):
            for name, llm in engines.items():
                results[name].append(run(llm, prompts, params))

    print(
        f"{args.requests} requests of {args.prompt_len} + {args.output_len} tokens; hidden "
        f"{args.hidden}, {args.layers} layers; MoE: {args.experts} experts of "
        f"{args.expert_size}, top-{args.top_k}; dense MLP: {args.top_k * args.expert_size}; "
        f"{torch.get_num_threads()} threads; best / median of {args.rounds} alternating rounds"
    )
    for name, values in results.items():
        print(f"  {name:5s} {max(values):8.1f} / {statistics.median(values):8.1f} output tok/s")
    moe, dense = results["moe"], results["dense"]
    print(
        f"  MoE / dense: {max(moe) / max(dense):.2f}x best, "
        f"{statistics.median(moe) / statistics.median(dense):.2f}x median"
    )


if __name__ == "__main__":
    main()
