"""VliteConfig: every engine setting, validated once, from defaults, environment and kwargs.

Precedence: defaults < ``VLITE_*`` environment variables < keyword arguments
(``LLM(...)``). Settings are flat, with vLLM's names, so ``LLM(max_num_seqs=8)``,
``VLITE_MAX_NUM_SEQS=8`` and (later) ``--max-num-seqs 8`` all mean the same thing.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}

_DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048


class VliteConfig(BaseSettings):
    """The engine's configuration. Invalid values raise at construction, naming the field."""

    model_config = SettingsConfigDict(env_prefix="VLITE_", extra="forbid", frozen=True)

    model: str | None = Field(None, description="Hugging Face folder of the model to serve.")
    tokenizer: str | None = Field(None, description="Tokenizer folder; default: the model's.")
    load_format: Literal["auto", "safetensors", "dummy"] = Field(
        "auto", description="'dummy' initialises random weights from config.json alone."
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="'auto': float32 on CPU, bfloat16 on CUDA."
    )
    device: Literal["auto", "cpu", "cuda"] = "auto"
    seed: int = Field(0, description="Seed of the engine's random generator.")
    max_model_len: int | None = Field(
        None, ge=1, description="Longest context; default: the model's max_position_embeddings."
    )

    scheduler: str = Field("fcfs", description="Scheduler plugin name.")
    attention_backend: str = Field("torch", description="Attention backend plugin name.")
    sampler: str = Field("default", description="Sampler plugin name.")
    executor: str = Field("uniproc", description="Executor plugin name.")
    tensor_parallel_size: int = Field(1, ge=1)

    max_num_seqs: int = Field(256, ge=1, description="Most requests in one step's batch.")
    max_num_batched_tokens: int | None = Field(
        None, ge=1, description="Token budget per step; default: max(2048, max_model_len)."
    )

    block_size: int = Field(16, ge=1, description="Token slots per KV-cache block.")
    enable_prefix_caching: bool = True
    num_kv_blocks: int | None = Field(
        None, ge=1, description="KV-cache blocks; overrides kv_cache_memory_gib."
    )
    kv_cache_memory_gib: float | None = Field(
        None,
        gt=0,
        description="Memory for the KV cache; default: 2 GiB on CPU, 90% of free memory on CUDA.",
    )

    @field_validator("block_size")
    @classmethod
    def _block_size_is_power_of_two(cls, value: int) -> int:
        if value & (value - 1):
            raise ValueError(f"block_size={value} must be a power of two")
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
