"""Llama-family GGUF files (llama.cpp's format): config, weights and tokenizer.

A GGUF file holds everything a model needs: llama.cpp-named metadata (the config), the
tokenizer with its chat template, and the tensors, most of them block-quantized. This module
turns it into what the rest of vlite expects from a Hugging Face folder:

- :func:`gguf_hf_config`: a ``transformers`` config (``LlamaConfig``, ``Qwen2Config`` or
  ``Qwen3Config``) rebuilt from the metadata;
- :func:`iter_gguf_weights`: ``(Hugging Face name, tensor)`` pairs shaped as in a
  safetensors checkpoint: float32, dequantized one tensor at a time, or, for the block types
  the caller asks to keep, :class:`~vlite.models.quantization.BlockQuantizedTensor`;
- :func:`load_gguf_tokenizer`: the ``transformers`` tokenizer stored in the file.

Two traps of the format, handled here:

- Tensor names differ (``blk.3.attn_q.weight`` is ``model.layers.3.self_attn.q_proj.weight``).
- For the ``llama`` architecture, llama.cpp's converter reorders the rows of every head of
  the Q and K projections: Hugging Face's RoPE rotates the pair ``(x[i], x[i + d/2])``
  ("rotate half") while llama.cpp's rotates ``(x[2i], x[2i + 1])``, so the converter
  interleaves the two halves of each head. :func:`unpermute_qk` undoes that. ``qwen2`` and
  ``qwen3`` files are converted without it (llama.cpp runs them with "rotate half" RoPE).

Parsing a file's header (about 2 s for a 49k-token vocabulary) is done once per process:
:func:`read_gguf` keeps the last few files it read in memory (nothing is cached on disk).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from vlite.models.quantization import BlockQuantizedTensor

#: GGUF ``general.architecture`` -> Hugging Face architecture (class) name.
GGUF_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}

#: Metadata arrays longer than this (the vocabulary, the BPE merges) are not kept by
#: :func:`read_gguf`: the config needs none of them and the tokenizer reads its own.
_MAX_KEPT_ARRAY_LEN = 1024

#: Architectures whose Q/K rows llama.cpp's converter permutes (see the module docstring).
_PERMUTED_QK_ARCHITECTURES = frozenset({"llama"})

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

_LAYER_MODULES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}

_LAYER_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


class _ArrayReader(gguf.GGUFReader):
    """A ``GGUFReader`` that parses a plain ndarray view of its memory map.

    Same bytes, same results, about twice as fast: the reader slices its ``numpy.memmap``
    once per value (hundreds of thousands of times for a vocabulary), and every memmap
    slice pays for ``memmap.__array_finalize__``. The view keeps the map alive.
    """

    @property
    def data(self) -> np.ndarray:
        return self._array

    @data.setter
    def data(self, value: np.ndarray) -> None:
        self._array = value.view(np.ndarray)


@dataclass(frozen=True, eq=False)
class GGUFFile:
    """A parsed GGUF file: metadata (minus long arrays) and tensors (views of the file).

    Attributes:
        path: the file.
        metadata: key -> value for every scalar and every array of at most 1024 items.
        tensors: ``gguf.ReaderTensor`` per tensor, in file order; ``.data`` maps the file.
    """

    path: Path
    metadata: Mapping[str, Any]
    tensors: tuple[gguf.ReaderTensor, ...]

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    @property
    def tensor_names(self) -> frozenset[str]:
        return frozenset(tensor.name for tensor in self.tensors)

    def arch_value(self, key: str, default: Any = ...) -> Any:
        """The metadata value ``<architecture>.<key>``; raises if absent and no default."""
        full_key = f"{self.architecture}.{key}"
        if full_key in self.metadata:
            return self.metadata[full_key]
        if default is ...:
            raise ValueError(f"{self.path}: GGUF metadata has no {full_key!r}")
        return default


def read_gguf(path: str | Path) -> GGUFFile:
    """Parse ``path``'s header; the result is kept in memory while the file is unchanged.

    Raises:
        FileNotFoundError: no such file.
        ValueError: not a GGUF file (the message names the path).
    """
    path = Path(path).resolve()
    stat = path.stat()
    return _read_gguf(path, stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=2)
def _read_gguf(path: Path, size: int, mtime_ns: int) -> GGUFFile:
    # ``size`` and ``mtime_ns`` only key the cache: a rewritten file is read again.
    try:
        reader = _ArrayReader(path)
    except (ValueError, KeyError) as error:
        raise ValueError(f"{path} is not a readable GGUF file: {error}") from error
    metadata = {}
    for key, field in reader.fields.items():
        is_array = field.types and field.types[0] == gguf.GGUFValueType.ARRAY
        if is_array and len(field.data) > _MAX_KEPT_ARRAY_LEN:
            continue
        metadata[key] = field.contents()
    return GGUFFile(path, metadata, tuple(reader.tensors))


# ---- config -----------------------------------------------------------------------------


def gguf_hf_config(gguf_file: GGUFFile) -> Any:
    """A ``transformers`` config for the model in ``gguf_file``, built from its metadata.

    Raises:
        ValueError: an architecture other than llama, qwen2 and qwen3, or missing metadata.
        NotImplementedError: RoPE scaling (``rope.scaling.*`` metadata or a
            ``rope_freqs.weight`` tensor), which vlite cannot rebuild from a GGUF file.
    """
    import transformers

    architecture = gguf_file.architecture
    if architecture not in GGUF_ARCHITECTURES:
        raise ValueError(
            f"{gguf_file.path}: GGUF architecture {architecture!r} is not supported "
            f"(supported: {', '.join(sorted(GGUF_ARCHITECTURES))})"
        )
    _check_no_rope_scaling(gguf_file)
    value = gguf_file.arch_value
    names = gguf_file.tensor_names
    num_heads = int(value("attention.head_count"))
    hidden_size = int(value("embedding_length"))
    fields: dict[str, Any] = {
        "architectures": [GGUF_ARCHITECTURES[architecture]],
        # The embedding's rows are the truth; the vocab_size key is optional in GGUF.
        "vocab_size": _hf_shape(_tensor(gguf_file, "token_embd.weight"))[0],
        "hidden_size": hidden_size,
        "intermediate_size": int(value("feed_forward_length")),
        "num_hidden_layers": int(value("block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(value("attention.head_count_kv", num_heads)),
        "head_dim": int(value("attention.key_length", hidden_size // num_heads)),
        "max_position_embeddings": int(value("context_length")),
        "rms_norm_eps": float(value("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(value("rope.freq_base", 10000.0)),
        "hidden_act": "silu",
        "tie_word_embeddings": "output.weight" not in names,
    }
    if architecture != "qwen2":  # Qwen2 always has q/k/v biases; its config has no flag
        fields["attention_bias"] = "blk.0.attn_q.bias" in names
    if architecture == "llama":
        fields["mlp_bias"] = "blk.0.ffn_up.bias" in names
    for name in ("bos", "eos", "padding", "unknown"):
        token_id = gguf_file.metadata.get(f"tokenizer.ggml.{name}_token_id")
        if token_id is not None:
            hf_name = {"padding": "pad", "unknown": "unk"}.get(name, name)
            fields[f"{hf_name}_token_id"] = int(token_id)
    config_cls = getattr(
        transformers, GGUF_ARCHITECTURES[architecture].replace("ForCausalLM", "Config")
    )
    return config_cls(**fields)


def _check_no_rope_scaling(gguf_file: GGUFFile) -> None:
    scaling = gguf_file.arch_value("rope.scaling.type", "none")
    if scaling != "none":
        raise NotImplementedError(
            f"{gguf_file.path}: RoPE scaling {scaling!r} in a GGUF file is not supported"
        )
    if "rope_freqs.weight" in gguf_file.tensor_names:
        raise NotImplementedError(
            f"{gguf_file.path}: per-frequency RoPE factors (rope_freqs.weight, as in Llama 3.1 "
            "GGUF files) are not supported; load the Hugging Face checkpoint instead"
        )


def _tensor(gguf_file: GGUFFile, name: str) -> gguf.ReaderTensor:
    for tensor in gguf_file.tensors:
        if tensor.name == name:
            return tensor
    raise ValueError(f"{gguf_file.path}: GGUF file has no tensor {name!r}")


def _hf_shape(tensor: gguf.ReaderTensor) -> tuple[int, ...]:
    """GGUF lists dimensions innermost first; PyTorch outermost first."""
    return tuple(int(n) for n in reversed(tensor.shape.tolist()))


# ---- weights ----------------------------------------------------------------------------


def hf_weight_name(gguf_name: str) -> str:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``.

    Raises:
        ValueError: a tensor name vlite does not know.
    """
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_NAME.fullmatch(gguf_name)
    if match is None or match.group(2) not in _LAYER_MODULES:
        raise ValueError(f"unknown GGUF tensor {gguf_name!r} (not a Llama-family weight)")
    layer, module, kind = match.groups()
    return f"model.layers.{layer}.{_LAYER_MODULES[module]}.{kind}"


def permute_qk(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """What llama.cpp's converter does to Q/K rows: per head, ``[h0 | h1]`` -> interleaved.

    Within each head of ``head_dim`` rows, row ``half * head_dim/2 + i`` moves to row
    ``2 * i + half``. ``weight``: ``[num_heads * head_dim, ...]`` (a matrix or a bias).
    Used by tests to write GGUF files; :func:`unpermute_qk` is its inverse.
    """
    head_dim = weight.shape[0] // num_heads
    heads = weight.reshape(num_heads, 2, head_dim // 2, *weight.shape[1:])
    return heads.transpose(1, 2).reshape(weight.shape)


def unpermute_qk(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo :func:`permute_qk`: per head, row ``2 * i + half`` -> ``half * head_dim/2 + i``."""
    head_dim = weight.shape[0] // num_heads
    heads = weight.reshape(num_heads, head_dim // 2, 2, *weight.shape[1:])
    return heads.transpose(1, 2).reshape(weight.shape)


def dequantize_tensor(tensor: gguf.ReaderTensor) -> torch.Tensor:
    """A (possibly quantized) GGUF tensor as a new float32 tensor in PyTorch's shape order."""
    values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    # F32 tensors come back as views of the read-only file map: copy those.
    values = np.array(values, dtype=np.float32, copy=not values.flags.writeable)
    return torch.from_numpy(values.reshape(_hf_shape(tensor)))


def tensor_type_names(gguf_file: GGUFFile) -> list[str]:
    """The GGUF type name (``"Q4_1"``, ``"F32"``, ...) of every tensor, in file order."""
    return [tensor.tensor_type.name for tensor in gguf_file.tensors]


def block_tensor(tensor: gguf.ReaderTensor) -> BlockQuantizedTensor:
    """A 2-D block-quantized GGUF tensor as a copy of its bytes, one row per matrix row."""
    rows, cols = _hf_shape(tensor)
    raw = np.array(tensor.data, copy=True).view(np.uint8).reshape(rows, -1)
    return BlockQuantizedTensor(tensor.tensor_type.name, torch.from_numpy(raw), cols)


def iter_gguf_weights(
    path: str | Path, *, keep_types: frozenset[str] = frozenset(), show_progress: bool = True
) -> Iterator[tuple[str, torch.Tensor | BlockQuantizedTensor]]:
    """Yield ``(Hugging Face name, tensor)`` for every tensor in the GGUF file.

    Matrices whose GGUF type is in ``keep_types`` (see
    :data:`vlite.models.quantization.KERNEL_TYPES`) come as
    :class:`~vlite.models.quantization.BlockQuantizedTensor`; every other tensor is
    dequantized to float32, one at a time, on the CPU. A progress bar goes to stderr; Q/K
    rows of ``llama`` files are restored to Hugging Face's order (see module docstring).
    """
    from tqdm.auto import tqdm

    gguf_file = read_gguf(path)
    config = gguf_hf_config(gguf_file)  # also rejects unsupported architectures
    heads = {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads}
    is_permuted = gguf_file.architecture in _PERMUTED_QK_ARCHITECTURES
    tensors = tqdm(gguf_file.tensors, desc="Loading GGUF", unit="tensor", disable=not show_progress)
    for tensor in tensors:
        name = hf_weight_name(tensor.name)
        keep = tensor.tensor_type.name in keep_types and len(tensor.shape) == 2
        weight = block_tensor(tensor) if keep else dequantize_tensor(tensor)
        projection = name.rsplit(".", 2)[-2]
        if is_permuted and projection in heads:
            weight = _unpermute(weight, heads[projection])
        yield name, weight


def _unpermute(weight, num_heads: int):
    if isinstance(weight, BlockQuantizedTensor):  # whole rows move: the blocks follow
        return BlockQuantizedTensor(
            weight.qtype, unpermute_qk(weight.blocks, num_heads).contiguous(), weight.cols
        )
    return unpermute_qk(weight, num_heads)


# ---- tokenizer --------------------------------------------------------------------------


def load_gguf_tokenizer(path: str | Path, hf_config: Any | None = None) -> Any:
    """The ``transformers`` tokenizer (with its chat template) stored in a GGUF file.

    The class is the one ``AutoTokenizer`` picks for ``hf_config`` (default: the model's
    config, from the file). Naming it directly skips ``AutoTokenizer``'s own pass over
    the file to rebuild a config, which takes several seconds.
    """
    path = Path(path)
    if hf_config is None:
        hf_config = gguf_hf_config(read_gguf(path))
    tokenizer_cls = _tokenizer_class(hf_config)
    return tokenizer_cls.from_pretrained(str(path.parent), gguf_file=path.name)


def _tokenizer_class(hf_config: Any) -> Any:
    from transformers import AutoTokenizer

    try:
        from transformers import TokenizersBackend
        from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING
    except ImportError:  # transformers 4.x: let AutoTokenizer choose (slower)
        return AutoTokenizer
    tokenizer_cls = TOKENIZER_MAPPING.get(type(hf_config), TokenizersBackend)
    if isinstance(tokenizer_cls, tuple):  # (slow, fast) in older layouts
        tokenizer_cls = tokenizer_cls[-1] or tokenizer_cls[0]
    return tokenizer_cls or TokenizersBackend
