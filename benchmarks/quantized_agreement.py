"""How closely the quantized path follows the float32 path on the default model.

Runs the same greedy prompts through ``LLM(quantization="auto")`` (GGUF blocks kept,
C kernels) and ``LLM(quantization="none")`` (weights dequantized to float32, PyTorch
ops) and prints how often the first token agrees and the mean length of the identical
prefix of the two generations. Both use exactly the file's weight values; they differ
only in the order of float32 sums, which can tip a near-tie between two tokens.

    python benchmarks/quantized_agreement.py                   # 200 prompts, 64 tokens
    python benchmarks/quantized_agreement.py --num-prompts 50 --max-tokens 32
"""

from __future__ import annotations

import argparse
import random

WORDS = [
    "the",
    "a",
    "robot",
    "sea",
    "engine",
    "quick",
    "brown",
    "fox",
    "river",
    "light",
    "code",
    "paper",
    "song",
    "city",
    "night",
    "garden",
    "story",
    "teacher",
    "window",
    "music",
    "market",
    "winter",
    "mountain",
    "letter",
]


def make_prompts(num_prompts: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choices(WORDS, k=rng.randint(3, 12))) for _ in range(num_prompts)]


def generate(prompts: list[str], max_tokens: int, quantization: str) -> list[list[int]]:
    from vlite import LLM, SamplingParams

    llm = LLM(quantization=quantization)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [list(output.outputs[0].token_ids) for output in outputs]


def identical_prefix(a: list[int], b: list[int]) -> int:
    length = 0
    for x, y in zip(a, b):
        if x != y:
            break
        length += 1
    return length


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-prompts", type=int, default=200)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    prompts = make_prompts(args.num_prompts, args.seed)
    quantized = generate(prompts, args.max_tokens, "auto")
    reference = generate(prompts, args.max_tokens, "none")
    first = sum(q[0] == r[0] for q, r in zip(quantized, reference))
    prefixes = [identical_prefix(q, r) for q, r in zip(quantized, reference)]
    full = sum(p == args.max_tokens for p in prefixes)
    print(
        f"{args.num_prompts} prompts, {args.max_tokens} greedy tokens: first token agrees "
        f"{first}/{args.num_prompts} ({100 * first / args.num_prompts:.1f}%), mean identical "
        f"prefix {sum(prefixes) / len(prefixes):.1f} tokens, {full} generations identical"
    )


if __name__ == "__main__":
    main()
