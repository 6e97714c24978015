"""Worker: owns one device, the model (or its shard) and its KV cache."""

from __future__ import annotations

import os

import torch

from vlite.core.attention_selection import limits_violation, resolve_attention_backend
from vlite.core.config import VliteConfig
from vlite.core.outputs import ModelRunnerOutput, SchedulerOutput
from vlite.core.plugins import PluginRegistry
from vlite.distributed.parallel_state import SINGLE_RANK, TensorParallelGroup
from vlite.distributed.pipeline import SINGLE_STAGE, PipelineParallelGroup
from vlite.models.loader import build_model
from vlite.models.spec import ModelSpec
from vlite.worker.cpu_memory import reuse_freed_memory
from vlite.worker.cpu_threads import (
    ThreadGovernor,
    read_cpu_times,
    resolve_cpu_threads,
    use_cpu_threads,
)
from vlite.worker.logits_processors import LogitsProcessorPipeline
from vlite.worker.model_runner import ModelRunner

_GIB = 1 << 30
_DEFAULT_CPU_KV_CACHE_GIB = 2.0
_CUDA_FREE_MEMORY_FRACTION = 0.9


class Worker:
    """Loads the model, sizes and allocates the KV cache, and runs steps on its device.

    Args:
        config: the engine configuration.
        registry: the plugin classes (model, attention backend, sampler, logits
            processors).
        tp_group: the tensor-parallel ranks this worker's model shard belongs to.
        pp_group: this worker's pipeline stage (its layers; only the last stage samples).
        device: the device to use; default ``config.torch_device``.
    """

    def __init__(
        self,
        config: VliteConfig,
        registry: PluginRegistry,
        tp_group: TensorParallelGroup = SINGLE_RANK,
        pp_group: PipelineParallelGroup = SINGLE_STAGE,
        device: torch.device | None = None,
    ) -> None:
        self.config = config
        self.registry = registry
        self.tp_group = tp_group
        self.pp_group = pp_group
        self.device = device if device is not None else config.torch_device
        self.dtype = config.torch_dtype
        self.model_spec = ModelSpec.from_config(config)
        #: Adapts the CPU thread count to other processes' load (``cpu_threads`` unset).
        self.thread_governor: ThreadGovernor | None = None
        if self.device.type == "cpu":
            reuse_freed_memory()
        if self.device.type == "cpu" and not tp_group.is_parallel and pp_group.num_stages == 1:
            # Multiproc workers get their count from the executor (split over ranks).
            num_threads = resolve_cpu_threads(config.cpu_threads)
            use_cpu_threads(num_threads)
            if config.cpu_threads is None and _can_read_cpu_times():
                self.thread_governor = ThreadGovernor(num_threads)
        self.model_runner: ModelRunner | None = None
        #: The attention backend in use (what "auto" resolved to), set by load_model.
        self.attention_backend_name: str | None = None
        torch.manual_seed(config.seed)

    def load_model(self) -> None:
        spec = self.model_spec
        model_cls = self.registry.get("model", spec.architecture)
        head_dim = spec.head_dim
        # "auto" becomes the backend it picks for this device and dtype.
        self.attention_backend_name, attn_backend_cls = resolve_attention_backend(
            self.config.attention_backend,
            self.device,
            self.dtype,
            self.registry,
            head_dim=head_dim,
            block_size=self.config.block_size,
        )
        _check_backend_supports(
            attn_backend_cls,
            self.attention_backend_name,
            self.dtype,
            head_dim,
            self.config.block_size,
        )
        self.quantization = spec.quantization_plan(self.config.quantization, self.device)
        model = build_model(
            spec.hf_config,
            model_cls,
            attn_backend_cls,
            block_size=self.config.block_size,
            dtype=self.dtype,
            device=self.device,
            load_format=self.config.load_format,
            weights=spec.iter_weights(self.quantization.keep_types),
            tp_group=self.tp_group,
            pp_group=self.pp_group,
        )
        sampler = self.registry.get("sampler", self.config.sampler)()
        self.model_runner = ModelRunner(
            model, sampler, self.config.block_size, self.device, self._logits_processors()
        )

    def _logits_processors(self) -> LogitsProcessorPipeline:
        """Every registered logits processor, on the stage that samples (the last)."""
        if not self.pp_group.is_last:
            return LogitsProcessorPipeline([])
        return LogitsProcessorPipeline.from_registry(
            self.registry, self.config, self.device, self.model_spec.vocab_size
        )

    @property
    def reports_samples(self) -> bool:
        """Whether this worker's sampled tokens go back to the engine: the first
        tensor-parallel rank of the last pipeline stage (every rank of that stage samples
        the same tokens)."""
        return self.pp_group.is_last and self.tp_group.rank == 0

    @property
    def runner(self) -> ModelRunner:
        if self.model_runner is None:
            raise RuntimeError("Worker.load_model() must run before the worker is used")
        return self.model_runner

    def kv_cache_bytes_per_block(self) -> int:
        model = self.runner.model
        shape = model.attention.kv_cache_shape(1)
        return model.num_layers * int(torch.Size(shape).numel()) * self.dtype.itemsize

    def determine_num_kv_blocks(self) -> int:
        """``num_kv_blocks`` if set, else what the memory budget holds (capped by need)."""
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        budget = self._kv_cache_budget_bytes()
        num_blocks = int(budget // self.kv_cache_bytes_per_block())
        blocks_per_seq = -(-self.model_spec.max_model_len // self.config.block_size)
        num_blocks = min(num_blocks, blocks_per_seq * self.config.max_num_seqs)
        if num_blocks < 1:
            raise ValueError(
                f"the KV-cache budget of {budget / _GIB:.2f} GiB holds no block of "
                f"{self.kv_cache_bytes_per_block()} bytes; raise kv_cache_memory_gib"
            )
        return num_blocks

    def _kv_cache_budget_bytes(self) -> float:
        if self.config.kv_cache_memory_gib is not None:
            return self.config.kv_cache_memory_gib * _GIB
        if self.device.type == "cuda":
            free_bytes, _ = torch.cuda.mem_get_info(self.device)
            return free_bytes * _CUDA_FREE_MEMORY_FRACTION
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        return min(_DEFAULT_CPU_KV_CACHE_GIB * _GIB, available / 4)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.runner.initialize_kv_cache(num_blocks, self.dtype)

    def execute_model(self, scheduler_output: SchedulerOutput) -> None:
        if self.thread_governor is not None:
            self.thread_governor.on_step()
        self.runner.execute_model(scheduler_output)

    def sample_tokens(self) -> ModelRunnerOutput:
        return self.runner.sample_tokens()


def _can_read_cpu_times() -> bool:
    try:
        read_cpu_times()
    except (OSError, ValueError, IndexError):
        return False  # not Linux: keep the fixed count
    return True


def _check_backend_supports(
    backend_cls, name: str, dtype: torch.dtype, head_dim: int, block_size: int
) -> None:
    violation = limits_violation(backend_cls, dtype, head_dim, block_size)
    if violation is not None:
        raise ValueError(f"attention backend {name!r} does not support {violation}")
