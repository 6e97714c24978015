"""GGUF files (llama.cpp's format): config, weights and tokenizer.

A GGUF file holds everything a model needs: llama.cpp-named metadata (the config), the
tokenizer with its chat template, and the tensors, most of them block-quantized. This module
turns it into what the rest of vlite expects from a Hugging Face folder:

- :func:`gguf_hf_config`: a ``transformers`` config rebuilt from the metadata (see
  :mod:`vlite.models.gguf_config` for the architectures: llama, Mixtral as llama, qwen2,
  qwen3, smollm3, phi3, qwen2moe, qwen3moe, olmoe, gemma2, gemma3);
- :func:`iter_gguf_weights`: ``(Hugging Face name, tensor)`` pairs shaped as in a
  safetensors checkpoint: float32, dequantized one tensor at a time, or, for the types the
  caller keeps, the weight format's :class:`~vlite.core.weight_format.QuantizedWeight`
  (loaded from the file's bytes);
- :func:`load_gguf_tokenizer`: the ``transformers`` tokenizer stored in the file.

Four traps of the format, handled here:

- Tensor names differ (``blk.3.attn_q.weight`` is ``model.layers.3.self_attn.q_proj.weight``):
  the model class names them (its ``hf_name_for_gguf_tensor``; the Llama family's tables are
  in :mod:`vlite.models.gguf_names`).
- Experts are stacked: ``blk.N.ffn_gate_exps.weight`` ``[num_experts, inner, hidden]``
  holds every expert's gate. Each expert's slice is yielded under its own Hugging Face
  name, quantized (its rows of the stack's bytes) when its type is kept, else dequantized
  alone.
- For llama-family architectures (``llama``, hence Mixtral, and ``smollm3``) llama.cpp's
  converter reorders the rows of every head of the Q and K projections: Hugging Face's
  RoPE rotates the pair ``(x[i], x[i + d/2])`` ("rotate half") while llama.cpp runs these
  architectures with RoPE on ``(x[2i], x[2i + 1])``, so the converter interleaves the two
  halves of each head. :func:`unpermute_qk` undoes that. The other architectures
  (``qwen2``, ``qwen3``, ``phi3``, ``qwen2moe``, ``qwen3moe``, ``olmoe``, ``gemma2``,
  ``gemma3``) are converted without it: llama.cpp runs them with "rotate half" RoPE.
- Gemma's RMSNorms scale by ``1 + weight`` (Hugging Face stores ``weight`` centred on 0);
  llama.cpp's scale by the stored vector, so its converter writes every Gemma norm weight
  (``*norm.weight``: the four per layer, Gemma 3's q/k norms, the final norm) plus 1, and
  :func:`iter_gguf_weights` subtracts 1 again (:data:`SHIFTED_NORM_ARCHITECTURES`).

The header is read by :mod:`vlite.models.gguf_header` (the vocabulary is stepped over, not
decoded: 0.1 s for Gemma 3's 262k tokens) once per process: :func:`read_gguf` keeps the last
few files it read in memory (nothing is cached on disk).
"""

from __future__ import annotations

import functools
import mmap
import weakref
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from vlite.core.errors import ConfigError
from vlite.core.weight_format import QuantizedWeight, WeightFormat
from vlite.models.gguf_config import gguf_hf_config
from vlite.models.gguf_header import GGUFHeaderError, read_header
from vlite.models.gguf_names import ExpertTensor, expert_tensor, hf_name_for_gguf_tensor
from vlite.models.gguf_names import hf_weight_name as hf_weight_name  # re-exported
from vlite.plugins.weight_formats.gguf import GGUF_FORMAT

#: Metadata arrays longer than this (the vocabulary, the BPE merges) are not kept by
#: :func:`read_gguf`: the config needs none of them and the tokenizer reads its own.
_MAX_KEPT_ARRAY_LEN = 1024

#: GGUF architectures whose Q/K rows llama.cpp's converter permutes: those llama.cpp runs
#: with RoPE on adjacent pairs (see the module docstring).
PERMUTED_QK_ARCHITECTURES = frozenset({"llama", "smollm3"})

#: GGUF architectures whose norm weights llama.cpp's converter stores plus 1 (see the
#: module docstring), and that shift.
SHIFTED_NORM_ARCHITECTURES = frozenset({"gemma2", "gemma3"})
_NORM_SHIFT = 1.0


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
    mapping: Any = None
    address: int = 0

    def release_pages(self, tensor: gguf.ReaderTensor) -> None:
        """Drop the pages of ``tensor``'s bytes from this process's resident memory (they
        stay in the OS page cache and are read again if touched). The loader calls it once
        a tensor is copied or decoded, so a file's pages and their copies are not resident
        together; the matrices kept in their blocks are views of the map and keep theirs
        (the weights are the file's pages: no second copy) until a layer copies them."""
        self.release_bytes(int(tensor.data_offset), int(tensor.n_bytes))

    def release_bytes(self, offset: int, num_bytes: int) -> None:
        """:meth:`release_pages` for bytes ``offset .. offset + num_bytes`` of the file (the
        whole pages among them). The map is private and never written, so a page let go
        that is read again is read from the file: releasing is always safe."""
        if self.mapping is None or not hasattr(mmap, "MADV_DONTNEED"):
            return
        page = mmap.PAGESIZE
        first = -(-offset // page) * page
        end = (offset + num_bytes) // page * page
        if end > first:
            self.mapping.madvise(mmap.MADV_DONTNEED, first, end - first)

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    @property
    def tensor_names(self) -> frozenset[str]:
        return frozenset(tensor.name for tensor in self.tensors)

    def hf_shape(self, tensor_name: str) -> tuple[int, ...] | None:
        """The shape of tensor ``tensor_name`` in PyTorch's order; None if there is none."""
        for tensor in self.tensors:
            if tensor.name == tensor_name:
                return _hf_shape(tensor)
        return None

    def arch_value(self, key: str, default: Any = ...) -> Any:
        """The metadata value ``<architecture>.<key>``; raises if absent and no default."""
        full_key = f"{self.architecture}.{key}"
        if full_key in self.metadata:
            return self.metadata[full_key]
        if default is ...:
            raise ConfigError(f"{self.path}: GGUF metadata has no {full_key!r}")
        return default


def _hf_shape(tensor: gguf.ReaderTensor) -> tuple[int, ...]:
    """GGUF lists dimensions innermost first; PyTorch outermost first."""
    return tuple(int(n) for n in reversed(tensor.shape.tolist()))


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
        header = read_header(path, max_array_len=_MAX_KEPT_ARRAY_LEN)
    except GGUFHeaderError as error:
        raise ConfigError(f"{path} is not a readable GGUF file: {error}") from error
    return GGUFFile(path, header.metadata, header.tensors, header.mapping, header.address)


# ---- weights ----------------------------------------------------------------------------


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
    return _float32(gguf.quants.dequantize(tensor.data, tensor.tensor_type), _hf_shape(tensor))


def dequantize_expert(tensor: gguf.ReaderTensor, expert: int) -> torch.Tensor:
    """Expert ``expert``'s matrix of a stacked ``[num_experts, rows, cols]`` GGUF tensor,
    dequantized alone (one expert's float32 copy in memory, not the whole stack's)."""
    values = gguf.quants.dequantize(tensor.data[expert], tensor.tensor_type)
    return _float32(values, _hf_shape(tensor)[1:])


def _float32(values: np.ndarray, shape: tuple[int, ...]) -> torch.Tensor:
    # F32 tensors come back as views of the read-only file map: copy those.
    values = np.array(values, dtype=np.float32, copy=not values.flags.writeable)
    return torch.from_numpy(values.reshape(shape))


def tensor_type_names(gguf_file: GGUFFile) -> list[str]:
    """The GGUF type name (``"Q4_1"``, ``"F32"``, ...) of every tensor, in file order."""
    return [tensor.tensor_type.name for tensor in gguf_file.tensors]


def raw_rows(data: np.ndarray, rows: int) -> torch.Tensor:
    """A matrix's stored bytes as a ``uint8`` tensor ``[rows, row_bytes]`` (what
    :meth:`~vlite.core.weight_format.WeightFormat.load` takes): a view of ``data`` when it
    is contiguous and writable (a tensor of :func:`read_gguf`'s copy-on-write map: the
    file's pages, no second copy), else a copy."""
    view = _rows_view(data, rows)
    if view is not None:
        return torch.from_numpy(view)
    return torch.from_numpy(np.array(data, copy=True).view(np.uint8).reshape(rows, -1))


def _rows_view(data: np.ndarray, rows: int) -> np.ndarray | None:
    """``data``'s bytes as a new ``uint8`` view ``[rows, row_bytes]``, or ``None`` where a
    view cannot be handed out (not contiguous, or read-only)."""
    if data.flags.c_contiguous and data.flags.writeable:
        return data.view(np.uint8).reshape(rows, -1)
    return None


class _MappedViews:
    """The views of a file's map the loader handed out; once nothing holds one any more (a
    layer joined it into a fused weight: a copy), its pages are let go."""

    def __init__(self, gguf_file: GGUFFile) -> None:
        self.gguf_file = gguf_file
        self.held: list[tuple[int, int, weakref.ref]] = []

    def track(self, view: np.ndarray) -> None:
        offset = int(view.ctypes.data) - self.gguf_file.address
        self.held.append((offset, int(view.nbytes), weakref.ref(view)))

    def release_dropped(self) -> None:
        still_held = []
        for offset, num_bytes, view in self.held:
            if view() is None:
                self.gguf_file.release_bytes(offset, num_bytes)
            else:
                still_held.append((offset, num_bytes, view))
        self.held = still_held


def block_tensor(tensor: gguf.ReaderTensor) -> QuantizedWeight:
    """A 2-D block-quantized GGUF tensor as the built-in ``gguf`` format's weight (its
    bytes, one row per matrix row: see :func:`raw_rows`)."""
    rows, cols = _hf_shape(tensor)
    return GGUF_FORMAT.load(tensor.tensor_type.name, raw_rows(tensor.data, rows), (rows, cols))


#: ``name_of(gguf_name, expert=None)``: the Hugging Face name of a GGUF tensor (of one expert
#: of a stacked experts tensor).
TensorNamer = Callable[..., str]


def iter_gguf_weights(
    path: str | Path,
    *,
    keep_types: frozenset[str] = frozenset(),
    formats: Mapping[str, WeightFormat] | None = None,
    model_cls: type | None = None,
    show_progress: bool = True,
) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """Yield ``(Hugging Face name, tensor)`` for every tensor in the GGUF file.

    Matrices whose GGUF type has a format in ``formats`` (tensor type -> weight format: the
    quantization plan's ``formats``) come as that format's
    :class:`~vlite.core.weight_format.QuantizedWeight`, loaded from the file's bytes; types
    in ``keep_types`` use the built-in ``gguf`` format (see
    :data:`vlite.models.quantization.KERNEL_TYPES`). Every other tensor is dequantized to
    float32, one at a time, on the CPU. A stacked expert tensor yields one matrix per
    expert. Names come from ``model_cls.hf_name_for_gguf_tensor`` (default: the class vlite
    registers for the file's architecture; a class without the method gets the Llama
    family's names). A progress bar goes to stderr; Q/K rows of llama-family files are
    restored to Hugging Face's order (a quantized matrix's rows of bytes move with them) and
    Gemma's norm weights to Hugging Face's centring on 0 (see the module docstring).
    """
    from tqdm.auto import tqdm

    keep = {tensor_type: GGUF_FORMAT for tensor_type in keep_types} | dict(formats or {})
    gguf_file = read_gguf(path)
    config = gguf_hf_config(gguf_file)  # also rejects unsupported architectures
    name_of = tensor_namer(model_cls or builtin_model_class(config.architectures[0]))
    heads = {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads}
    is_permuted = gguf_file.architecture in PERMUTED_QK_ARCHITECTURES
    norms_shifted = gguf_file.architecture in SHIFTED_NORM_ARCHITECTURES
    tensors = tqdm(gguf_file.tensors, desc="Loading GGUF", unit="tensor", disable=not show_progress)
    views = _MappedViews(gguf_file)
    for tensor in tensors:
        views.release_dropped()  # what a layer copied since (its fused q/k/v, gate/up)
        keeps_file_pages = False
        try:
            weight_format = keep.get(tensor.tensor_type.name)
            experts = expert_tensor(tensor.name)
            if experts is not None:
                keeps_file_pages = weight_format is not None
                yield from _expert_weights(tensor, experts, name_of, weight_format, views)
                continue
            name = name_of(tensor.name)
            projection = name.rsplit(".", 2)[-2]
            num_heads = heads[projection] if is_permuted and projection in heads else None
            if weight_format is not None and len(tensor.shape) == 2:
                # kept as the file's bytes (a view of the map) unless its rows move
                keeps_file_pages = num_heads is None
                yield name, _load_quantized(tensor, tensor.data, weight_format, num_heads, views)
                continue
            weight = dequantize_tensor(tensor)
            if num_heads is not None:
                weight = unpermute_qk(weight, num_heads)
            if projection == "shared_expert_gate":
                weight = weight.reshape(1, -1)  # [1, hidden]; the converter squeezes it to [hidden]
            if norms_shifted and _is_norm_weight(tensor.name):
                weight = weight - _NORM_SHIFT  # norms are vectors: always dequantized, float32
            yield name, weight
        finally:
            if not keeps_file_pages:
                gguf_file.release_pages(tensor)  # its bytes are copied or decoded: off our RSS
    views.release_dropped()


def tensor_namer(model_cls: type) -> TensorNamer:
    """How ``model_cls`` names GGUF tensors: its ``hf_name_for_gguf_tensor`` classmethod,
    else the Llama family's names (:func:`vlite.models.gguf_names.hf_name_for_gguf_tensor`)."""
    hook = getattr(model_cls, "hf_name_for_gguf_tensor", None)
    return hook if callable(hook) else hf_name_for_gguf_tensor


@functools.cache
def builtin_model_class(architecture: str) -> type:
    """The class vlite's built-in plugins register for Hugging Face ``architecture``."""
    from vlite.core.plugins import PluginRegistry, build_plugin_manager

    registry = PluginRegistry(build_plugin_manager(load_entry_points=False))
    return registry.get("model", architecture)


def _load_quantized(
    tensor: gguf.ReaderTensor,
    data: np.ndarray,
    weight_format: WeightFormat,
    num_heads: int | None = None,
    views: _MappedViews | None = None,
) -> QuantizedWeight:
    """One matrix of ``tensor`` (``data``: its bytes, or one expert's) loaded by
    ``weight_format``, its Q/K rows unpermuted first when ``num_heads`` is given (whole rows
    move: their bytes follow). A view of the map handed out is tracked by ``views``."""
    rows, cols = _hf_shape(tensor)[-2:]
    view = _rows_view(data, rows) if num_heads is None else None
    if view is None:
        raw = raw_rows(data, rows)
        if num_heads is not None:
            raw = unpermute_qk(raw, num_heads).contiguous()
    else:
        raw = torch.from_numpy(view)
        if views is not None:
            views.track(view)
    return weight_format.load(tensor.tensor_type.name, raw, (rows, cols))


def _is_norm_weight(gguf_name: str) -> bool:
    """Whether ``gguf_name`` is an RMSNorm's weight (``blk.3.post_ffw_norm.weight``,
    ``output_norm.weight``, ...): the tensors the converter shifts for Gemma."""
    return gguf_name.endswith("norm.weight")


def _expert_weights(
    tensor: gguf.ReaderTensor,
    experts: ExpertTensor,
    name_of: TensorNamer,
    weight_format: WeightFormat | None,
    views: _MappedViews | None = None,
) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
    """The Hugging Face-named matrices of one expert tensor (stacked or one expert's),
    quantized by ``weight_format`` when one is given."""
    if experts.expert is not None:
        if weight_format is not None:
            weight = _load_quantized(tensor, tensor.data, weight_format, views=views)
            yield name_of(tensor.name), weight
        else:
            yield name_of(tensor.name), dequantize_tensor(tensor)
        return
    for expert in range(_hf_shape(tensor)[0]):
        name = name_of(tensor.name, expert=expert)
        if weight_format is not None:
            yield name, _load_quantized(tensor, tensor.data[expert], weight_format, views=views)
        else:
            yield name, dequantize_expert(tensor, expert)


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
