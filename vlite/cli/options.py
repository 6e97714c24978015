"""Click options shared by commands, each mapped to a VliteConfig field."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import click
from pydantic import ValidationError

from vlite.core.config import VliteConfig

#: (flag, config field, click keyword arguments) for every engine setting with a flag.
ENGINE_OPTIONS: list[tuple[str, str, dict[str, Any]]] = [
    ("--model", "model", {"help": "HF folder, .gguf file or hub id (default: SmolLM2-135M)."}),
    ("--tokenizer", "tokenizer", {"help": "Tokenizer folder, if not the model's."}),
    (
        "--load-format",
        "load_format",
        {
            "type": click.Choice(["auto", "safetensors", "dummy"]),
            "help": "'dummy': random weights.",
        },
    ),
    (
        "--dtype",
        "dtype",
        {"type": click.Choice(["auto", "float32", "bfloat16", "float16"]), "help": "Model dtype."},
    ),
    (
        "--quantization",
        "quantization",
        {
            "type": click.Choice(["auto", "gguf", "none"]),
            "help": "'auto': keep GGUF Q4_0/Q4_1/Q8_0 weights quantized (CPU) where possible; "
            "'gguf': or fail; 'none': dequantize.",
        },
    ),
    ("--device", "device", {"type": click.Choice(["auto", "cpu", "cuda"])}),
    (
        "--cpu-threads",
        "cpu_threads",
        {"type": int, "help": "CPU threads per worker (default: physical cores)."},
    ),
    ("--max-model-len", "max_model_len", {"type": int, "help": "Longest context in tokens."}),
    ("--seed", "seed", {"type": int, "help": "Seed of the engine's random generator."}),
    ("--scheduler", "scheduler", {"help": "Scheduler plugin (see `vlite plugins list`)."}),
    ("--attn", "attention_backend", {"help": "Attention backend plugin."}),
    ("--sampler", "sampler", {"help": "Sampler plugin."}),
    ("--executor", "executor", {"help": "Executor plugin."}),
    ("--tp", "tensor_parallel_size", {"type": int, "help": "Tensor-parallel size."}),
    ("--max-num-seqs", "max_num_seqs", {"type": int, "help": "Most requests per step."}),
    (
        "--max-num-batched-tokens",
        "max_num_batched_tokens",
        {"type": int, "help": "Token budget per step."},
    ),
    ("--block-size", "block_size", {"type": int, "help": "Token slots per KV-cache block."}),
    (
        "--prefix-caching/--no-prefix-caching",
        "enable_prefix_caching",
        {"default": None, "help": "Reuse KV blocks of shared prompt prefixes."},
    ),
    ("--num-kv-blocks", "num_kv_blocks", {"type": int, "help": "KV-cache blocks (overrides GiB)."}),
    ("--kv-cache-memory-gib", "kv_cache_memory_gib", {"type": float, "help": "KV-cache memory."}),
]

CONFIG_FILE_OPTION = click.option(
    "--config",
    "config_file",
    type=click.Path(dir_okay=False),
    envvar="VLITE_CONFIG",
    help="TOML file of settings (file < VLITE_* environment < flags).",
)


def engine_options(command: Callable) -> Callable:
    """Add every engine flag and ``--config`` to a click command."""
    for flag, field, kwargs in reversed(ENGINE_OPTIONS):
        command = click.option(flag, field, **{"default": None, **kwargs})(command)
    return CONFIG_FILE_OPTION(command)


def pop_engine_overrides(options: dict[str, Any]) -> dict[str, Any]:
    """Remove the engine flags from a command's keyword arguments; return the given ones."""
    fields = [field for _, field, _ in ENGINE_OPTIONS]
    return {field: options.pop(field) for field in fields if field in options}


def build_config(config_file: str | None, overrides: dict[str, Any]) -> VliteConfig:
    """The effective config; invalid settings become a one-line click error."""
    try:
        return VliteConfig.load(config_file, **overrides)
    except ValidationError as exc:
        raise click.UsageError(describe_validation_error(exc)) from None
    except (ValueError, FileNotFoundError) as exc:
        raise click.UsageError(str(exc)) from None


def describe_validation_error(exc: ValidationError) -> str:
    """One line per invalid field: ``field=value: why``."""
    problems = []
    for error in exc.errors():
        field = ".".join(str(part) for part in error["loc"]) or "config"
        message = error["msg"].removeprefix("Value error, ")
        problems.append(f"invalid {field}={error.get('input')!r}: {message}")
    return "; ".join(problems)
