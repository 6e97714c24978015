"""How closely one engine configuration follows another's greedy output.

By default: the quantized path, ``LLM(quantization="auto")`` (GGUF blocks kept, C
kernels), against the float32 path, ``LLM(quantization="none")`` (weights dequantized to
float32, PyTorch ops), on the default model. Prints how often the first greedy token
agrees and the mean length of the identical prefix of the two generations. Those two use
exactly the file's weight values and differ only in the order of float32 sums, which can
tip a near-tie between two tokens; ``--candidate dtype=bfloat16`` measures what bfloat16
costs instead.

    python benchmarks/agreement.py                               # 200 prompts, 64 tokens
    python benchmarks/agreement.py --num-prompts 50 --max-tokens 32
    python benchmarks/agreement.py --candidate quantization=none,dtype=bfloat16
    python benchmarks/agreement.py --reference quantized_activations=off,max_num_seqs=8 \
        --candidate quantized_activations=int16,max_num_seqs=8 \
        --candidate quantized_activations=int8,max_num_seqs=8    # one reference, two candidates
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


def parse_settings(text: str) -> dict[str, str]:
    """``"a=1,b=x"`` -> ``{"a": "1", "b": "x"}`` (vlite's config parses the values)."""
    pairs = [item.split("=", 1) for item in text.split(",") if item]
    return {key.strip(): value.strip() for key, value in pairs}


def generate(prompts: list[str], max_tokens: int, settings: dict[str, str]) -> list[list[int]]:
    from vlite import LLM, SamplingParams

    llm = LLM(**settings)
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
    parser.add_argument(
        "--candidate",
        action="append",
        help="KEY=VALUE,... (repeat for several, each against the one reference; "
        "default: quantization=auto)",
    )
    parser.add_argument("--reference", default="quantization=none", help="KEY=VALUE,...")
    args = parser.parse_args()
    prompts = make_prompts(args.num_prompts, args.seed)
    reference = generate(prompts, args.max_tokens, parse_settings(args.reference))
    for candidate in args.candidate or ["quantization=auto"]:
        outputs = generate(prompts, args.max_tokens, parse_settings(candidate))
        print(f"candidate {candidate} vs reference {args.reference}")
        first = sum(q[0] == r[0] for q, r in zip(outputs, reference))
        prefixes = [identical_prefix(q, r) for q, r in zip(outputs, reference)]
        full = sum(p == args.max_tokens for p in prefixes)
        print(
            f"{args.num_prompts} prompts, {args.max_tokens} greedy tokens: first token agrees "
            f"{first}/{args.num_prompts} ({100 * first / args.num_prompts:.1f}%), mean "
            f"identical prefix {sum(prefixes) / len(prefixes):.1f} tokens, {full} "
            "generations identical"
        )


if __name__ == "__main__":
    main()
