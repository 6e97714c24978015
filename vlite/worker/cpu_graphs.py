"""Decode steps replayed on the CPU: the C calls of a forward, recorded once per batch size.

On the CPU a decode step of a small model spends as long in Python as in its kernels: a
30-layer model makes about 270 C calls per token (products, norms, rotations, attention),
and each comes through a few module calls, shape checks and tensor allocations. When every
computing step of the forward is a C call of :mod:`vlite.kernels.native`, the forward is a
fixed list of those calls over fixed buffers, like a CUDA graph's kernels: this module
records it (:class:`NativeCallCapturer`, a :class:`~vlite.worker.cuda_graphs.GraphCapturer`)
and replays it without the Python around it. :class:`~vlite.worker.cuda_graphs.DecodeGraphs`
does the rest exactly as for CUDA graphs (persistent inputs rewritten in place, one
recording per batch size, eager for everything else). As a CUDA graph's capture launches
nothing, a recording runs none of the kernels (:func:`vlite.kernels.native.recording` with
``execute=False``: the guard below refuses any read of a computed value, so the forward's
Python cannot depend on them), so recording a size costs its Python only, whatever the
model.

A forward qualifies only if PyTorch computes nothing in it: while recording, a
torch-function mode lets through views, metadata reads and allocations (cut from one arena
all recordings share, as CUDA graphs share a pool) and refuses any other operation with
:class:`NotCapturable`, which names it; that batch size runs eagerly (a forward of many
rows may multiply in PyTorch where one of few does not), and if every size does, the whole
model, and the worker says why. Replays are the same C calls on the same memory, so their
results are bit for bit the eager forward's. The thread count is read at every replay.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.overrides import TorchFunctionMode

from vlite.kernels import native
from vlite.kernels.call_replay import compile_replay
from vlite.worker.cuda_graphs import NotCapturable

#: Functions that allocate a new tensor: served from the capturer's arena while recording.
_ALLOCATIONS = frozenset({"empty", "empty_like", "new_empty"})
#: Functions that only read a tensor's metadata (never its values).
_METADATA = frozenset(
    {"__get__", "data_ptr", "stride", "size", "dim", "numel", "element_size", "is_contiguous"}
    | {"storage_offset", "__len__", "untyped_storage", "nbytes"}
)
#: Alignment of each tensor in the arena (a cache line).
_ALIGN = 64


class _RecordingGuard(TorchFunctionMode):
    """Lets views, metadata reads and allocations through, refuses the rest: an operation
    that computes, writes, or reads values on the host. Allocations are cut from ``arena``
    (one after another, from its start) when one is given and has room, else allocated and
    kept; :attr:`used` counts the bytes either way.

    A torch-function mode, not a dispatch mode: the first dispatch mode of a process imports
    about 900 modules (sympy among them, some 145 MiB).
    """

    def __init__(self, arena: torch.Tensor | None) -> None:
        super().__init__()
        self.arena = arena
        self.used = 0
        #: Tensors allocated outside the arena (kept alive with the recording).
        self.kept: list[torch.Tensor] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        if _writes(name) or "out" in kwargs:
            raise NotCapturable(f"the forward writes a tensor in place with torch's {name}")
        result = func(*args, **kwargs)
        if name in _ALLOCATIONS:
            return self._allocate(result)
        if name in _METADATA or _aliases_an_input(result, args):
            return result
        raise NotCapturable(f"the forward computes torch's {name}, outside the C kernels")

    def _allocate(self, fresh: torch.Tensor) -> torch.Tensor:
        """``fresh``'s shape and dtype, contiguous, in the arena when it has room."""
        nbytes = fresh.numel() * fresh.element_size()
        start, self.used = self.used, self.used + -(-nbytes // _ALIGN) * _ALIGN
        if self.arena is None or self.used > self.arena.numel():
            self.kept.append(fresh)
            return fresh
        piece = self.arena[start : start + nbytes].view(fresh.dtype)
        return piece.view(fresh.shape)


def _writes(name: str) -> bool:
    """Whether a tensor function of this name writes in place (``add_``, ``__iadd__``,
    ``__setitem__``)."""
    if name.startswith("__") and name.endswith("__"):
        return name == "__setitem__" or name.startswith("__i") and name != "__index__"
    return name.endswith("_")


def _aliases_an_input(result: object, args: tuple) -> bool:
    """Whether ``result`` is a tensor (or tensors) viewing a tensor among ``args``."""
    outputs = result if isinstance(result, (tuple, list)) else (result,)
    storages = {arg.untyped_storage().data_ptr() for arg in args if isinstance(arg, torch.Tensor)}
    return bool(outputs) and all(
        isinstance(out, torch.Tensor) and out.untyped_storage().data_ptr() in storages
        for out in outputs
    )


class NativeCallCapturer:
    """Records a callable's C calls; the replay reruns exactly those calls.

    Satisfies :class:`~vlite.worker.cuda_graphs.GraphCapturer`. Every recording's
    intermediate tensors share one arena (replays never overlap, as CUDA graphs share a
    pool), sized by :meth:`size_memory` or else by the first recording (then record the
    largest batch first). A replay rewrites the outputs of the others.
    :attr:`retained_bytes`: the memory the recordings keep.
    """

    def __init__(self) -> None:
        self.arena: torch.Tensor | None = None
        self._kept: list[list[torch.Tensor]] = []
        self.retained_bytes = 0

    def size_memory(
        self, forward_of: Callable[[int], Callable[[], torch.Tensor]], largest: int
    ) -> None:
        """Size the shared arena for recordings of up to ``largest`` rows, from recordings
        of ``forward_of(1)`` and ``forward_of(2)``: every intermediate tensor of a forward
        has a size affine in its rows, so the two give the largest's (a recording that
        needs more keeps its own tensors). Raises :class:`NotCapturable` as
        :meth:`capture` would."""
        used = [self._memory_of(forward_of(rows)) for rows in range(1, min(largest, 2) + 1)]
        per_row = used[1] - used[0] if len(used) == 2 else 0
        self._reserve_arena(used[0] + per_row * (largest - 1))

    def _reserve_arena(self, nbytes: int) -> None:
        """The shared arena of ``nbytes`` (resident only as recordings use it)."""
        self.arena = torch.empty(nbytes, dtype=torch.uint8)
        self.retained_bytes += nbytes

    @staticmethod
    def _memory_of(fn: Callable[[], torch.Tensor]) -> int:
        """The arena bytes a recording of ``fn`` takes."""
        sizing = _RecordingGuard(None)
        with native.recording(execute=False) as calls, sizing:
            fn()
        if not calls:
            raise NotCapturable("the forward makes no C kernel call")
        return sizing.used

    def capture(self, fn: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
        """``(replay, output)``: ``output`` holds ``fn``'s result after each ``replay()``
        (not before: recording runs no kernel). Raises :class:`NotCapturable` when ``fn``
        computes outside the C kernels (or makes no C call at all)."""
        if self.arena is None:  # size the arena by a first, discarded recording
            self._reserve_arena(self._memory_of(fn))
        guard = _RecordingGuard(self.arena)
        with native.recording(execute=False) as calls, guard:
            output = fn()
        if not calls:
            raise NotCapturable("the forward makes no C kernel call")
        self._kept.append(guard.kept)
        self.retained_bytes += sum(t.untyped_storage().nbytes() for t in guard.kept)

        replay_calls = compile_replay(calls)  # in C where it can, else one by one

        def replay() -> None:
            replay_calls(torch.get_num_threads())

        return replay, output
