"""How a model is split over ranks: its layers into pipeline stages, its heads over
tensor-parallel ranks, and whether a model class can be split at all.

Read by the configuration phase (:mod:`vlite.core.verify`) before any worker starts, and by
each worker's pipeline stage (:mod:`vlite.distributed.pipeline`) for its own layers.
"""

from __future__ import annotations

from typing import Any

from vlite.core.config import VliteConfig
from vlite.core.errors import ConfigError, VliteError


def stage_layer_ranges(
    num_layers: int, num_stages: int, partition: tuple[int, ...] | None = None
) -> list[tuple[int, int]]:
    """``[(start, end), ...]``: the layers of each stage, contiguous, in order.

    Equal runs, the first ``num_layers % num_stages`` stages taking one more, or
    ``partition`` (``pp_layer_partition``): the layers of each stage, in stage order.

    Raises:
        ConfigError: more stages than layers, or a ``partition`` that does not give every
            stage at least one layer and all ``num_layers`` layers in all.
    """
    if partition is None:
        if num_stages > num_layers:
            raise ConfigError(
                f"pipeline_parallel_size={num_stages} exceeds the model's {num_layers} layers "
                "(every stage needs at least one)"
            )
        base, extra = divmod(num_layers, num_stages)
        partition = tuple(base + (stage < extra) for stage in range(num_stages))
    if len(partition) != num_stages or min(partition) < 1 or sum(partition) != num_layers:
        raise ConfigError(
            f"pp_layer_partition={','.join(map(str, partition))} must give each of the "
            f"{num_stages} stages at least one layer and {num_layers} layers in all"
        )
    ranges, start = [], 0
    for size in partition:
        ranges.append((start, start + size))
        start += size
    return ranges


def check_model_split(
    config: VliteConfig, model_cls: type, hf_config: Any, architecture: str
) -> None:
    """Refuse ``tensor_parallel_size`` and ``pipeline_parallel_size`` (and
    ``pp_layer_partition``) that ``model_cls`` cannot be split by.

    Raises:
        ConfigError: the class lacks the parallelism asked for, a stage would get no
            layer, or the model's heads do not split over the ranks (the class's
            ``check_tensor_parallel_size``; a plain ``ValueError`` from it becomes a
            ``ConfigError`` naming the setting).
    """
    if config.pipeline_parallel_size > 1:
        _check_pipeline_split(config, model_cls, hf_config, architecture)
    if config.tensor_parallel_size > 1:
        _check_tensor_split(config.tensor_parallel_size, model_cls, hf_config, architecture)


def _check_pipeline_split(
    config: VliteConfig, model_cls: type, hf_config: Any, architecture: str
) -> None:
    pp = config.pipeline_parallel_size
    if not getattr(model_cls, "supports_pipeline_parallel", False):
        raise ConfigError(
            f"model class {model_cls.__qualname__} ({architecture}) does not support "
            f"pipeline parallelism; pipeline_parallel_size={pp} needs one that does "
            "(allowed here: pipeline_parallel_size=1)"
        )
    stage_layer_ranges(hf_config.num_hidden_layers, pp, config.pp_layer_partition)


def _check_tensor_split(tp: int, model_cls: type, hf_config: Any, architecture: str) -> None:
    if not getattr(model_cls, "supports_tensor_parallel", False):
        raise ConfigError(
            f"model class {model_cls.__qualname__} ({architecture}) does not support "
            f"tensor parallelism; tensor_parallel_size={tp} needs one that does "
            "(allowed here: tensor_parallel_size=1)"
        )
    check = getattr(model_cls, "check_tensor_parallel_size", None)
    if check is None:
        return
    try:
        check(hf_config, tp)
    except VliteError:
        raise
    except ValueError as exc:  # a plugin's plain refusal, as its interface allows
        raise ConfigError(f"tensor_parallel_size={tp}: {exc}") from exc
