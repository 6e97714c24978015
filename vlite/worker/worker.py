"""Worker: owns one device, the model (or its shard) and its KV cache."""

from __future__ import annotations

import os
import sys
from concurrent.futures import Future
from typing import Any

import torch

from vlite.core.attention_selection import resolve_attention_backend, resolve_kv_cache_dtype
from vlite.core.config import VliteConfig
from vlite.core.errors import ConfigError
from vlite.core.memory import WorkerMemory
from vlite.core.outputs import ModelRunnerOutput, SchedulerOutput
from vlite.core.plugins import PluginRegistry
from vlite.core.weight_format import registered_weight_formats
from vlite.distributed.parallel_state import SINGLE_RANK, TensorParallelGroup
from vlite.distributed.pipeline import SINGLE_STAGE, PipelineParallelGroup
from vlite.models.layer_kernels import load_fused_ops
from vlite.models.loader import build_model
from vlite.models.rope import limit_rotary_positions
from vlite.models.spec import ModelSpec
from vlite.worker.cpu_graphs import NativeCallCapturer, NotCapturable
from vlite.worker.cpu_memory import reuse_freed_memory
from vlite.worker.cpu_threads import (
    ThreadGovernor,
    read_cpu_times,
    resolve_cpu_threads,
    use_cpu_threads,
)
from vlite.worker.cuda_graphs import CaptureReport, CudaGraphCapturer, capture_sizes
from vlite.worker.draft_model import DraftModel
from vlite.worker.logits_processors import LogitsProcessorPipeline
from vlite.worker.model_runner import ModelRunner

_GIB = 1 << 30
_DEFAULT_CPU_KV_CACHE_GIB = 2.0
_CUDA_FREE_MEMORY_FRACTION = 0.9
#: The largest CPU decode batch whose C calls are recorded and replayed (larger batches
#: spend little of their step in Python).
CPU_REPLAY_MAX_SEQS = 32


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
        #: What capturing the decode graphs cost (``None``: none captured).
        self.cuda_graph_report: CaptureReport | None = None
        torch.manual_seed(config.seed)

    def load_model(self) -> None:
        spec = self.model_spec
        # The engine's configuration phase (vlite.core.verify) resolved "auto" and checked
        # the backend's limits; this finds the class and asks it whether it runs on this
        # worker's own device (a Ray rank's node may lack a package the engine's has).
        # "auto" is resolved here only for a Worker built outside an engine.
        self.attention_backend_name, attn_backend_cls = resolve_attention_backend(
            self.config.attention_backend,
            self.device,
            self.dtype,
            self.registry,
            head_dim=spec.head_dim,
            block_size=self.config.block_size,
        )
        #: The dtype the KV cache stores (``kv_cache_dtype``, resolved for the backend).
        self.kv_cache_dtype = resolve_kv_cache_dtype(
            self.config.kv_cache_dtype,
            self.dtype,
            self.device,
            attn_backend_cls,
            self.attention_backend_name,
            gguf=spec.is_gguf,
        )
        # The plan the engine checked, made again for the formats this worker loads with.
        self.quantization = spec.quantization_plan(
            self.config.quantization,
            self.device,
            registered_weight_formats(self.registry, self.config),
        )
        model = self._build_model(spec, attn_backend_cls, self.quantization)
        sampler = self.registry.get("sampler", self.config.sampler)()
        self.model_runner = ModelRunner(
            model,
            sampler,
            self.config.block_size,
            self.device,
            self._logits_processors(),
            self._load_draft_model(attn_backend_cls),
        )

    def _build_model(self, spec: ModelSpec, attn_backend_cls: type, quantization) -> Any:
        """``spec``'s model on this worker's device, rank and stage."""
        model_cls = self.registry.get("model", spec.architecture)
        model = build_model(
            spec.hf_config,
            model_cls,
            attn_backend_cls,
            block_size=self.config.block_size,
            dtype=self.dtype,
            device=self.device,
            load_format=self.config.load_format,
            weights=spec.iter_weights(formats=quantization.formats, model_cls=model_cls),
            tp_group=self.tp_group,
            pp_group=self.pp_group,
        )
        limit_rotary_positions(model, self.longest_sequence())
        if self.device.type == "cuda" and hasattr(model, "use_fused_ops"):
            model.use_fused_ops(load_fused_ops(self.device))  # one kernel per norm, RoPE, SwiGLU
        return model

    def _load_draft_model(self, attn_backend_cls: type) -> DraftModel | None:
        """Speculative decoding's draft model (``model_spec.draft``), with the same
        attention backend and quantization setting as the target; ``None`` without one."""
        draft = self.model_spec.draft
        if draft is None:
            return None
        quantization = draft.quantization_plan(
            self.config.quantization,
            self.device,
            registered_weight_formats(self.registry, self.config),
        )
        model = self._build_model(draft, attn_backend_cls, quantization)
        runner = ModelRunner(model, None, self.config.block_size, self.device)
        return DraftModel(runner, self.model_spec.vocab_size)

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

    def _models(self) -> list[torch.nn.Module]:
        """The model, and the draft model if there is one."""
        draft = self.runner.draft_model
        return [self.runner.model] + ([draft.runner.model] if draft is not None else [])

    def kv_cache_bytes_per_block(self) -> int:
        """Bytes of one KV-cache block over this worker's layers (and heads), the draft
        model's included (its cache has as many blocks)."""
        total = 0
        for model in self._models():
            shape = model.attention.kv_cache_shape(1)
            total += (
                model.num_layers * int(torch.Size(shape).numel()) * self.kv_cache_dtype.itemsize
            )
        return total

    def weights_bytes(self) -> int:
        """Bytes this worker's models hold (see :func:`model_weights_bytes`)."""
        return sum(model_weights_bytes(model) for model in self._models())

    def memory_report(self) -> WorkerMemory:
        """What this worker holds: its weights and one KV-cache block."""
        return WorkerMemory(self.weights_bytes(), self.kv_cache_bytes_per_block())

    def determine_num_kv_blocks(self) -> int:
        """``num_kv_blocks`` if set, else the smaller of what the memory budget holds and
        what ``kv_cache_tokens`` need (default: ``max_num_seqs`` sequences of
        ``max_model_len`` tokens).

        Raises:
            ConfigError: the budget holds no block.
        """
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        budget = self._kv_cache_budget_bytes()
        block_bytes = self.kv_cache_bytes_per_block()
        budget_blocks = int(budget // block_bytes)
        if budget_blocks < 1:
            setting = (
                f"kv_cache_memory_gib={self.config.kv_cache_memory_gib}"
                if self.config.kv_cache_memory_gib is not None
                else "the default KV-cache budget"
            )
            raise ConfigError(
                f"{setting}: a budget of {budget / _GIB:.6f} GiB holds no KV-cache block of "
                f"{block_bytes} bytes; allowed: kv_cache_memory_gib >= "
                f"{block_bytes / _GIB:.6f}, or set num_kv_blocks"
            )
        return min(budget_blocks, self.needed_kv_blocks())

    def longest_sequence(self) -> int:
        """The most positions a sequence can reach (what the RoPE tables keep):
        ``max_model_len``, or the cache's size when ``num_kv_blocks`` or ``kv_cache_tokens``
        sets it smaller, since a sequence then never outgrows the cache (a one-prompt
        ``vlite run`` of Gemma 3 drops 64 MiB of tables for 32,768 positions) - unless every
        layer slides a window, whose blocks are released as the sequence goes on."""
        limit = self.model_spec.max_model_len
        windows = self.model_spec.sliding_windows
        if windows and all(window is not None for window in windows):
            return limit
        block_size = self.config.block_size
        if self.config.num_kv_blocks is not None:
            return min(limit, self.config.num_kv_blocks * block_size)
        if self.config.kv_cache_tokens is not None:
            return min(limit, -(-self.config.kv_cache_tokens // block_size) * block_size)
        return limit

    def needed_kv_blocks(self) -> int:
        """The blocks ``kv_cache_tokens`` need, or by default every one of ``max_num_seqs``
        sequences at ``max_model_len`` tokens."""
        block_size = self.config.block_size
        tokens = self.config.kv_cache_tokens
        if tokens is None:
            blocks_per_seq = -(-self.model_spec.max_model_len // block_size)
            return blocks_per_seq * self.config.max_num_seqs
        return -(-tokens // block_size)

    def _kv_cache_budget_bytes(self) -> float:
        if self.config.kv_cache_memory_gib is not None:
            return self.config.kv_cache_memory_gib * _GIB
        if self.device.type == "cuda":
            free_bytes, _ = torch.cuda.mem_get_info(self.device)
            return free_bytes * _CUDA_FREE_MEMORY_FRACTION
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        return min(_DEFAULT_CPU_KV_CACHE_GIB * _GIB, available / 4)

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate the KV cache; then capture the decode forward (CUDA graphs on CUDA, the
        C calls on the CPU) and print what that cost, or why there is none."""
        self.runner.initialize_kv_cache(num_blocks, self.kv_cache_dtype)
        if self.config.enforce_eager:
            return
        if self.device.type == "cpu":
            self._record_cpu_decode_steps()
            return
        if self.device.type != "cuda":
            return
        reason = self.cuda_graphs_unavailable_reason()
        if reason is not None:
            print(f"CUDA graphs: off ({reason})", file=sys.stderr, flush=True)
            return
        self.cuda_graph_report = self.runner.capture_decode_graphs(
            capture_sizes(self.config.resolved_max_cudagraph_capture_size),
            self.model_spec.max_model_len,
            CudaGraphCapturer(),
        )
        print(self.cuda_graph_report.describe(), file=sys.stderr, flush=True)

    def _record_cpu_decode_steps(self) -> None:
        """Record the C calls of decode steps of every size up to :data:`CPU_REPLAY_MAX_SEQS`
        sequences (no padding: a padding row costs a product row's arithmetic, and a step
        that verifies 4 drafts is a decode of 5), when the model's forward computes in the C
        kernels only (see :mod:`vlite.worker.cpu_graphs`: recording runs no kernel, so it
        costs the forward's Python only); the draft model's too, if there is one."""
        report = self._record_cpu_decode_steps_of(self.runner, "")
        if report is not None:
            self.cuda_graph_report = report
        draft = self.runner.draft_model
        if draft is not None:
            self._record_cpu_decode_steps_of(draft.runner, "draft model: ")

    def _record_cpu_decode_steps_of(self, runner: ModelRunner, label: str) -> CaptureReport | None:
        reason = self.cpu_replay_unavailable_reason(runner.model)
        if reason is None:
            try:
                largest = min(self.config.max_num_seqs, CPU_REPLAY_MAX_SEQS)
                report = runner.capture_decode_graphs(
                    tuple(range(1, largest + 1)),
                    self.model_spec.max_model_len,
                    NativeCallCapturer(),
                )
            except NotCapturable as error:
                runner.decode_graphs = None
                reason = str(error)
            else:
                print(f"{label}{report.describe()}", file=sys.stderr, flush=True)
                return report
        print(f"{label}CPU step replay: off ({reason})", file=sys.stderr, flush=True)
        return None

    def cpu_replay_unavailable_reason(self, model: torch.nn.Module | None = None) -> str | None:
        """Why this worker's CPU decode steps of ``model`` (default: the model) cannot be
        recorded (``None``: try)."""
        model = model if model is not None else self.runner.model
        if getattr(model, "native_ops", None) is None:
            return "the model does not compute with the C kernels"
        if self.attention_backend_name != "cpu":
            # Only vlite's C calls are recorded: a backend computing otherwise (the Triton
            # interpreter, NumPy) would be skipped on replay, unseen by the recording's guard.
            return f"attention backend {self.attention_backend_name!r} is not the C kernel 'cpu'"
        if self.tp_group.is_parallel or self.pp_group.num_stages > 1:
            return "not recorded with tensor or pipeline parallelism"
        return getattr(model, "replay_unavailable_reason", None)

    def cuda_graphs_unavailable_reason(self) -> str | None:
        """Why this worker's decode steps cannot be captured (``None``: they can)."""
        name = self.attention_backend_name
        if not getattr(self.registry.get("attention_backend", name), "supports_cuda_graphs", False):
            return f"attention backend {name!r} does not support them"
        if self.tp_group.is_parallel:
            return "not captured with tensor parallelism"
        if self.pp_group.num_stages > 1:
            return "not captured with pipeline parallelism"
        return getattr(self.runner.model, "replay_unavailable_reason", None)

    def execute_model(self, scheduler_output: SchedulerOutput) -> None:
        if self.thread_governor is not None:
            self.thread_governor.on_step()
        self.runner.execute_model(scheduler_output)

    def sample_tokens(self) -> ModelRunnerOutput:
        return self.runner.sample_tokens()

    def sample_tokens_deferred(self) -> Future[ModelRunnerOutput]:
        """:meth:`sample_tokens` with the tokens left on the device until ``result()``."""
        return self.runner.sample_tokens_deferred()


def _can_read_cpu_times() -> bool:
    try:
        read_cpu_times()
    except (OSError, ValueError, IndexError):
        return False  # not Linux: keep the fixed count
    return True


def model_weights_bytes(model: torch.nn.Module) -> int:
    """Bytes a model holds: its parameters and buffers, and for every module whose
    ``quantized`` attribute is not ``None`` that object's ``nbytes`` (its ``blocks``'
    where it has no ``nbytes``). A tensor or quantized object shared by several modules
    (tied embeddings) counts once."""
    total = sum(tensor.nbytes for tensor in model.parameters())
    total += sum(tensor.nbytes for tensor in model.buffers())
    seen: set[int] = set()
    for module in model.modules():
        quantized = getattr(module, "quantized", None)
        if quantized is None or id(quantized) in seen:
            continue
        seen.add(id(quantized))
        nbytes = getattr(quantized, "nbytes", None)
        total += int(nbytes) if nbytes is not None else int(quantized.blocks.nbytes)
    return total
