"""CUDA graphs for decode steps: the model's forward captured once per padded batch size.

A decode step of ``n`` sequences (one new token each) launches a few hundred small kernels;
at small batches the host's launches, not the GPU, set the pace. After the KV cache is
allocated the worker captures the model's forward for each size of :func:`capture_sizes`
(largest first, all graphs in one memory pool) over :class:`DecodeInputBuffers`, persistent
device tensors. A decode step of ``n <= largest`` sequences is then padded to the next
captured size, copied into those tensors and replayed with one launch; any other step
(prefills, larger batches) runs eagerly.

What a captured forward may read: the buffers' device tensors, rewritten in place before
every replay, and the capture-time host ints of :meth:`DecodeInputBuffers.metadata`, which
are bounds only (``max_query_len == 1``, ``max_seq_len`` = the model's longest context).
An attention backend declares that its ``forward`` keeps to this with
``AttentionBackend.supports_cuda_graphs``; the conformance suite checks the claim.

Padding rows compute garbage that nothing reads: token 0 at position 0, a context of one
key (whatever block 0 holds), and slot ``-1``, which every backend skips when it writes
keys and values.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from vlite.core.attention import AttentionMetadata

#: The slot of a padding row: backends skip negative slots when they write the KV cache.
PAD_SLOT = -1

#: The model's forward over one step: ``(input_ids [T], positions [T], metadata) -> hidden
#: [T, hidden]`` (the KV caches bound in).
DecodeForward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]


def capture_sizes(largest: int) -> tuple[int, ...]:
    """The padded batch sizes to capture: 1, 2, 4, 8, then every multiple of 16, up to and
    including ``largest`` (``>= 1``). A batch of ``n`` runs the graph of the smallest size
    ``>= n``, so at most 15 padding rows are computed above 16.

    >>> capture_sizes(40)
    (1, 2, 4, 8, 16, 32, 40)
    """
    if largest < 1:
        raise ValueError(f"largest={largest}: the largest captured batch must be >= 1")
    sizes = [size for size in (1, 2, 4, 8) if size <= largest]
    sizes += range(16, largest + 1, 16)
    if sizes[-1] != largest:
        sizes.append(largest)
    return tuple(sizes)


class DecodeInputBuffers:
    """The persistent device tensors a captured decode forward reads.

    Attributes:
        input_ids: ``[max_seqs]`` int64, one token per sequence.
        positions: ``[max_seqs]`` int64.
        slot_mapping: ``[max_seqs]`` int64 (``PAD_SLOT`` on padding rows).
        seq_lens: ``[max_seqs]`` int32 (1 on padding rows).
        query_start_loc: ``[max_seqs + 1]`` int32, ``0, 1, ..., max_seqs`` (never rewritten:
            every sequence brings one token).
        block_tables: ``[max_seqs, max_blocks_per_seq]`` int32; a step's rows are written up
            to its own width, entries past a sequence's context are never read.
    """

    def __init__(self, max_seqs: int, max_blocks_per_seq: int, device: torch.device) -> None:
        def zeros(*shape: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device)

        self.max_seqs = max_seqs
        self.input_ids = zeros(max_seqs, dtype=torch.int64)
        self.positions = zeros(max_seqs, dtype=torch.int64)
        self.slot_mapping = torch.full((max_seqs,), PAD_SLOT, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(max_seqs, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(max_seqs + 1, dtype=torch.int32, device=device)
        self.block_tables = zeros(max_seqs, max_blocks_per_seq, dtype=torch.int32)

    def metadata(self, size: int, max_seq_len: int) -> AttentionMetadata:
        """The metadata a graph of ``size`` rows is captured with: views of the buffers, and
        host ints that hold for every step it replays (``max_seq_len`` bounds every context;
        the per-sequence host lists are bounds too, not a step's values)."""
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:size],
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            block_tables=self.block_tables[:size],
            max_query_len=1,
            max_seq_len=max_seq_len,
            query_lens_cpu=[1] * size,
            seq_lens_cpu=[max_seq_len] * size,
        )

    def load(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        metadata: AttentionMetadata,
        size: int,
    ) -> None:
        """Write one decode step of ``n = len(input_ids) <= size`` sequences into rows
        ``0..n-1`` and padding into rows ``n..size-1``."""
        n = input_ids.shape[0]
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(metadata.slot_mapping)
        self.seq_lens[:n].copy_(metadata.seq_lens)
        width = metadata.block_tables.shape[1]
        self.block_tables[:n, :width].copy_(metadata.block_tables)
        if n < size:
            self.input_ids[n:size].zero_()
            self.positions[n:size].zero_()
            self.slot_mapping[n:size].fill_(PAD_SLOT)
            self.seq_lens[n:size].fill_(1)


class NotCapturable(Exception):
    """A capturer cannot record a forward: it computes where the capturer does not see
    (:class:`~vlite.worker.cpu_graphs.NativeCallCapturer` records the C kernels' calls
    only). Raised for one batch size, that size runs eagerly."""


class GraphCapturer(Protocol):
    """Turns a callable into ``(replay, output)``: ``replay()`` redoes the callable's work,
    rewriting ``output``, over the same inputs, or raises :class:`NotCapturable`. A capturer
    may also offer ``size_memory(forward_of, largest)``, which :meth:`DecodeGraphs.capture`
    calls first (:class:`~vlite.worker.cpu_graphs.NativeCallCapturer` sizes its shared
    memory there)."""

    def capture(
        self, fn: Callable[[], torch.Tensor]
    ) -> tuple[Callable[[], None], torch.Tensor]: ...


class CudaGraphCapturer:
    """Captures callables into ``torch.cuda.CUDAGraph`` objects sharing one memory pool
    (replays never overlap, so the graphs' intermediate tensors may share memory)."""

    def __init__(self) -> None:
        self.pool = torch.cuda.graph_pool_handle()

    def capture(self, fn: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
        """``(replay, output)``: ``replay()`` reruns ``fn``'s kernels, rewriting ``output``."""
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            output = fn()
        return graph.replay, output


@dataclass(frozen=True)
class CaptureReport:
    """What capturing cost: the sizes, the seconds and the device memory the graphs hold."""

    sizes: tuple[int, ...]
    seconds: float
    memory_bytes: int
    #: What was captured: ``"CUDA graphs"``, or ``"CPU step replay"`` (:mod:`.cpu_graphs`).
    kind: str = "CUDA graphs"
    #: The sizes asked for that the capturer refused (they run eagerly), ascending.
    eager_sizes: tuple[int, ...] = ()
    #: Why the smallest of :attr:`eager_sizes` was refused (``None`` when none was).
    eager_reason: str | None = None

    def describe(self) -> str:
        text = (
            f"{self.kind}: {len(self.sizes)} decode batch size{'s' * (len(self.sizes) > 1)} "
            f"({_size_ranges(self.sizes)}) captured in "
            f"{self.seconds:.1f} s, {self.memory_bytes / (1 << 20):.0f} MiB "
            "(--enforce-eager turns them off)"
        )
        if self.eager_sizes:
            text += f"; eager at {_size_ranges(self.eager_sizes)} ({self.eager_reason})"
        return text


def _size_ranges(sizes: tuple[int, ...]) -> str:
    """``(1, 2, 3, 8)`` -> ``"1-3, 8"``: ascending sizes as runs of consecutive ones.

    >>> _size_ranges((1, 2, 3, 8, 16, 17))
    '1-3, 8, 16-17'
    """
    runs: list[list[int]] = []
    for size in sizes:
        if runs and size == runs[-1][-1] + 1:
            runs[-1].append(size)
        else:
            runs.append([size])
    return ", ".join(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]) for run in runs)


class DecodeGraphs:
    """The model's decode forward, captured per padded batch size and replayed.

    Args:
        forward: the model's forward (:data:`DecodeForward`).
        buffers: the persistent inputs every graph reads.
        max_seq_len: the longest context any replayed step may have (the model's).
        capturer: a :class:`GraphCapturer`; :class:`CudaGraphCapturer` on CUDA (a test may
            pass one that reruns the callable, to check the buffers' discipline on a CPU).
    """

    def __init__(
        self,
        forward: DecodeForward,
        buffers: DecodeInputBuffers,
        max_seq_len: int,
        capturer: GraphCapturer,
    ) -> None:
        self.forward = forward
        self.buffers = buffers
        self.max_seq_len = max_seq_len
        self.capturer = capturer
        self._graphs: dict[int, tuple[Callable[[], None], torch.Tensor]] = {}
        #: The captured sizes, ascending.
        self.sizes: tuple[int, ...] = ()

    def capture(self, sizes: tuple[int, ...]) -> CaptureReport:
        """Capture one graph per size, largest first (later graphs reuse its pool memory);
        on CUDA each is run once eagerly first, so kernels compile outside the capture.
        A capturer that can size its shared memory beforehand (``size_memory``, the CPU's)
        does so for the largest. A size the capturer refuses (:class:`NotCapturable`: a
        forward of many rows may compute where it does not see) runs eagerly; a batch
        replays the next captured size up.

        Raises:
            NotCapturable: the capturer refused every size (nothing is replayed).
        """
        device = self.buffers.input_ids.device
        start = time.perf_counter()
        before = _reserved_bytes(device)
        size_memory = getattr(self.capturer, "size_memory", None)
        if size_memory is not None:
            size_memory(self._warmed_up_forward, max(sizes))
        refused: dict[int, NotCapturable] = {}
        for size in sorted(sizes, reverse=True):
            try:
                self._graphs[size] = self.capturer.capture(self._warmed_up_forward(size))
            except NotCapturable as error:
                refused[size] = error
        if not self._graphs:
            raise refused[min(refused)]
        self.sizes = tuple(sorted(self._graphs))
        _synchronize(device)
        eager = dict(
            eager_sizes=tuple(sorted(refused)),
            eager_reason=str(refused[min(refused)]) if refused else None,
        )
        if device.type == "cuda":
            memory = _reserved_bytes(device) - before
            return CaptureReport(self.sizes, time.perf_counter() - start, memory, **eager)
        retained = getattr(self.capturer, "retained_bytes", 0)
        return CaptureReport(
            self.sizes, time.perf_counter() - start, retained, kind="CPU step replay", **eager
        )

    def _warmed_up_forward(self, size: int) -> Callable[[], torch.Tensor]:
        """The forward over the buffers' first ``size`` rows (run once already on CUDA)."""
        buffers = self.buffers
        metadata = buffers.metadata(size, self.max_seq_len)

        def run() -> torch.Tensor:
            return self.forward(buffers.input_ids[:size], buffers.positions[:size], metadata)

        if buffers.input_ids.device.type == "cuda":  # nothing to compile on the CPU
            run()
            _synchronize(buffers.input_ids.device)
        return run

    def padded_size(self, num_seqs: int) -> int | None:
        """The captured size a decode batch of ``num_seqs`` replays (``None``: none fits)."""
        index = bisect.bisect_left(self.sizes, num_seqs)
        return self.sizes[index] if index < len(self.sizes) else None

    def replay(
        self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata
    ) -> torch.Tensor | None:
        """Hidden states ``[n, hidden]`` of a decode step, replayed; ``None`` when the step
        is not all decodes or is larger than every graph (run it eagerly)."""
        if not metadata.is_all_decode:
            return None
        num_seqs = input_ids.shape[0]
        size = self.padded_size(num_seqs)
        if size is None:
            return None
        self.buffers.load(input_ids, positions, metadata, size)
        replay, output = self._graphs[size]
        replay()
        return output[:num_seqs]


def _reserved_bytes(device: torch.device) -> int:
    return torch.cuda.memory_reserved(device) if device.type == "cuda" else 0


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
