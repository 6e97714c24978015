"""Build a model from named weights (a Hugging Face folder's safetensors, a GGUF file) or
dummy weights."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from vlite.core.attention import AttentionBackend
from vlite.core.config import setting_choices
from vlite.core.errors import ConfigError
from vlite.core.weight_format import QuantizedWeight
from vlite.distributed.parallel_state import SINGLE_RANK, TensorParallelGroup
from vlite.distributed.pipeline import SINGLE_STAGE, PipelineParallelGroup
from vlite.models.parallel_layers import ShardedModule

LOAD_FORMATS = setting_choices("load_format")
SAFETENSORS_INDEX = "model.safetensors.index.json"

#: Standard deviation of dummy weights: small enough that activations and logits stay
#: well-conditioned through many layers, large enough that logits do not tie.
DUMMY_WEIGHT_STD = 0.02
DUMMY_SEED = 0


def load_hf_config(folder: str | Path) -> Any:
    """Read ``config.json`` from ``folder`` into a ``transformers.PretrainedConfig``."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(folder))


def safetensors_files(folder: str | Path) -> list[Path]:
    """The checkpoint's ``*.safetensors`` files, via the index file when one is present.

    Raises:
        FileNotFoundError: the folder holds no safetensors file, or one the index names
            is absent.
    """
    folder = Path(folder)
    index = folder / SAFETENSORS_INDEX
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [folder / name for name in sorted(set(weight_map.values()))]
        absent = [str(f) for f in files if not f.is_file()]
        if absent:
            raise FileNotFoundError(f"{index} names missing files: {', '.join(absent)}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in model folder {folder}")
    return files


def iter_safetensors_weights(folder: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(name, tensor)`` for every tensor of every safetensors file in ``folder``.

    Tensors are read on the CPU in their stored dtype; a progress bar is shown when the
    checkpoint has more than one file.
    """
    files = safetensors_files(folder)
    if len(files) > 1:
        from tqdm.auto import tqdm

        files = tqdm(files, desc="Loading safetensors", unit="file")
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield name, f.get_tensor(name)


@contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Temporarily set ``torch.get_default_dtype()``."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def init_dummy_weights(model: nn.Module, std: float = DUMMY_WEIGHT_STD, seed: int = DUMMY_SEED):
    """Deterministically randomise weights: matrices ~ N(0, std), norms 1, biases 0.

    Values are drawn on the CPU from a seeded generator, so they do not depend on the device;
    a sharded layer (:class:`~vlite.models.parallel_layers.ShardedModule`) draws its full
    matrix and keeps its rank's slice, so every tensor-parallel size gets the same model.
    """
    generator = torch.Generator(device="cpu").manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith("bias"):
            param.data.zero_()
        elif param.dim() == 1:
            param.data.fill_(1.0)
        else:
            module_name, leaf = name.rsplit(".", 1)
            module = model.get_submodule(module_name)
            is_sharded = isinstance(module, ShardedModule)
            shape = module.full_shape(leaf) if is_sharded else param.shape
            values = torch.randn(shape, generator=generator, dtype=torch.float32) * std
            if is_sharded:
                module.load_full(leaf, values)
            else:
                param.data.copy_(values)


def build_model(
    hf_config: Any,
    model_cls: type[nn.Module],
    attn_backend_cls: type[AttentionBackend],
    *,
    block_size: int,
    dtype: torch.dtype,
    device: str | torch.device,
    load_format: str = "auto",
    folder: str | Path | None = None,
    weights: Iterable[tuple[str, torch.Tensor]] | None = None,
    tp_group: TensorParallelGroup = SINGLE_RANK,
    pp_group: PipelineParallelGroup = SINGLE_STAGE,
) -> nn.Module:
    """Construct ``model_cls(hf_config, attn_backend_cls, block_size)`` and fill its weights.

    The model is constructed with ``dtype`` as torch's default dtype and ``device`` as the
    default device, so parameters are born in place (no later cast or copy).

    Args:
        load_format: ``"auto"``/``"safetensors"`` load ``weights`` (or ``folder``'s
            safetensors); ``"dummy"`` draws deterministic random weights and reads nothing.
        folder: a Hugging Face model folder to read safetensors from.
        weights: ``(Hugging Face name, tensor)`` pairs from any source, consumed lazily
            (e.g. ``ModelSpec.iter_weights()``, safetensors or GGUF); not touched for
            ``"dummy"``. Exactly one of ``folder`` and ``weights`` is needed otherwise.
            Quantized weights (a weight format's
            :class:`~vlite.core.weight_format.QuantizedWeight`) reach only a class that sets
            ``supports_block_quantized_weights = True``; others get them dequantized.
        tp_group: the ranks the model is split over; at world size > 1 the class must set
            ``supports_tensor_parallel = True`` and is constructed with ``tp_group=``.
        pp_group: this worker's pipeline stage; with more than one stage the class must set
            ``supports_pipeline_parallel = True`` and is constructed with ``pp_group=`` (it
            builds and loads only its stage's layers).

    Returns:
        The model in eval mode, on ``device``, in ``dtype``, with ``requires_grad=False``.
    """
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format={load_format!r}; expected one of {LOAD_FORMATS}")
    if folder is not None and weights is not None:
        raise ValueError("pass a model folder or weights, not both")
    if load_format != "dummy" and folder is None and weights is None:
        raise ValueError(f"load_format={load_format!r} needs a model folder or weights")
    device = torch.device(device)
    parallel_kwargs = {}
    if tp_group.is_parallel:
        if not getattr(model_cls, "supports_tensor_parallel", False):
            raise ConfigError(
                f"model class {model_cls.__qualname__} does not support tensor parallelism "
                f"(tensor_parallel_size={tp_group.world_size}); use tensor_parallel_size=1"
            )
        parallel_kwargs["tp_group"] = tp_group
    if pp_group.num_stages > 1:
        if not getattr(model_cls, "supports_pipeline_parallel", False):
            raise ConfigError(
                f"model class {model_cls.__qualname__} does not support pipeline parallelism "
                f"(pipeline_parallel_size={pp_group.num_stages}); use pipeline_parallel_size=1"
            )
        parallel_kwargs["pp_group"] = pp_group
    with default_dtype(dtype), device, torch.no_grad():
        model = model_cls(hf_config, attn_backend_cls, block_size, **parallel_kwargs)
    model.requires_grad_(False)
    with torch.no_grad():
        if load_format == "dummy":
            init_dummy_weights(model)
        else:
            if weights is None:
                weights = iter_safetensors_weights(folder)
            if not getattr(model_cls, "supports_block_quantized_weights", False):
                weights = dequantized(weights)
            model.load_weights(weights)
    return model.eval()


def dequantized(
    weights: Iterable[tuple[str, Any]],
) -> Iterator[tuple[str, torch.Tensor]]:
    """``weights`` with every quantized weight dequantized to float32 by its weight format,
    for model classes that do not declare ``supports_block_quantized_weights = True``."""
    for name, tensor in weights:
        if isinstance(tensor, QuantizedWeight):
            tensor = tensor.format.dequantize(tensor)
        yield name, tensor
