"""ModelSpec: what the engine knows about a model before any weight is loaded."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vlite.core.config import VliteConfig
from vlite.models.loader import load_hf_config


@dataclass(frozen=True)
class ModelSpec:
    """A resolved model: where it lives, its Hugging Face config and its context length."""

    folder: Path
    hf_config: Any
    max_model_len: int

    @property
    def architecture(self) -> str:
        architectures = getattr(self.hf_config, "architectures", None) or []
        if not architectures:
            raise ValueError(f"{self.folder}/config.json names no 'architectures'")
        return architectures[0]

    @property
    def tokenizer_folder(self) -> Path:
        return self.folder

    @classmethod
    def from_config(cls, config: VliteConfig) -> ModelSpec:
        if config.model is None:
            raise ValueError("no model given: pass LLM(model=PATH) with a Hugging Face folder")
        folder = Path(config.model).expanduser()
        if not (folder / "config.json").is_file():
            raise FileNotFoundError(f"model={config.model!r}: no config.json in {folder}")
        hf_config = load_hf_config(folder)
        return cls(folder, hf_config, _max_model_len(config, hf_config))


def _max_model_len(config: VliteConfig, hf_config: Any) -> int:
    model_limit = getattr(hf_config, "max_position_embeddings", None)
    if config.max_model_len is None:
        if model_limit is None:
            raise ValueError("the model's config has no max_position_embeddings: set max_model_len")
        return model_limit
    if model_limit is not None and config.max_model_len > model_limit:
        raise ValueError(
            f"max_model_len={config.max_model_len} exceeds the model's "
            f"max_position_embeddings={model_limit}"
        )
    return config.max_model_len
