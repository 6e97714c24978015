"""Write a random-weight Hugging Face model folder of a real model's shape, for benchmarks.

Throughput depends on a model's shape, not on its weights, so on a machine with no network
(or no checkpoint) the GPU benchmarks run on a folder this script writes: ``config.json``
of the named shape, random ``bfloat16`` safetensors, and vlite's tiny offline tokenizer
(the benchmarks feed random token ids; the config keeps the real vocabulary size, so the
LM head costs what it costs in the real model).

    python benchmarks/random_model.py llama-1b /tmp/llama-1b
    python benchmarks/random_model.py llama-8b /tmp/llama-8b --config-only  # vlite's dummy load
    python benchmarks/throughput.py --model /tmp/llama-1b --device cuda --threads 1

``--gguf FILE`` also writes the folder as an F16 GGUF file, laid out as llama.cpp's converter
lays it out (the tokenizer padded with unused tokens to the config's vocabulary), for the
GGUF benchmarks: ``benchmarks/gguf_types.py --make-from FILE`` requantizes it to each type.

    python benchmarks/random_model.py llama-1b /tmp/llama-1b --gguf /tmp/llama-1b-F16.gguf
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

#: Shapes of real checkpoints (config fields); the weights are random.
SHAPES = {
    # Llama-3.2-1B
    "llama-1b": dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        vocab_size=128256,
        rope_theta=500000.0,
        tie_word_embeddings=True,
    ),
    # Llama-3.1-8B
    "llama-8b": dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=128256,
        rope_theta=500000.0,
        tie_word_embeddings=False,
    ),
    # Qwen2.5-0.5B
    "qwen2-0.5b": dict(
        architectures=["Qwen2ForCausalLM"],
        model_type="qwen2",
        hidden_size=896,
        intermediate_size=4864,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        vocab_size=151936,
        rope_theta=1000000.0,
        tie_word_embeddings=True,
    ),
    # SmolLM2-135M
    "smollm2-135m": dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        vocab_size=49152,
        rope_theta=100000.0,
        tie_word_embeddings=True,
    ),
}


def write_random_model(shape: str, path: Path, seed: int = 0, config_only: bool = False) -> Path:
    """Write ``shape``'s config, random bfloat16 weights and the tiny tokenizer to ``path``
    (with ``config_only``, no weights: vlite draws its own with ``load_format="dummy"``)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from vlite.testing.tiny_models import make_tiny_tokenizer

    fields = dict(SHAPES[shape])
    model_type = fields.pop("model_type")
    tokenizer = make_tiny_tokenizer()
    config = AutoConfig.for_model(
        model_type,
        max_position_embeddings=8192,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="bfloat16",
        **fields,
    )
    if config_only:
        config.save_pretrained(path)
        tokenizer.save_pretrained(path)
        return path
    torch.manual_seed(seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument("path", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--config-only",
        action="store_true",
        help="write no weights (for vlite with --load-format dummy; the peers need weights)",
    )
    parser.add_argument("--gguf", type=Path, help="also write the model as this F16 GGUF file")
    args = parser.parse_args()
    if args.gguf and args.config_only:
        parser.error("--gguf needs the weights: leave out --config-only")
    print(write_random_model(args.shape, args.path, args.seed, args.config_only))
    if args.gguf:
        from vlite.testing.tiny_gguf import write_tiny_gguf

        print(write_tiny_gguf(args.path, args.gguf, float_type="F16"))


if __name__ == "__main__":
    main()
