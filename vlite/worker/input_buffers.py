"""The persistent tensors every step's inputs are written into.

A step's flattened inputs (token ids, positions, cache slots, block tables, ...) are filled
in place into buffers allocated once and grown only when a step needs more, instead of
fresh tensors each step: the addresses stay put (what capturing a step into a CUDA graph
needs) and a step allocates nothing. Each buffer has a host side, written with NumPy, and a
device side: the same tensor on the CPU (a step's tensors are views of the buffers), a
device tensor on a GPU, filled by one non-blocking copy from pinned host memory.

A step's tensors are valid until the next step's :meth:`InputBuffers.begin`: that call
first waits, on a GPU, until the copies of the step before have run, so that overwriting
the host side cannot race a copy still in flight.
"""

from __future__ import annotations

import numpy as np
import torch

#: Each buffer's dtype (its name says what it holds: see
#: :class:`~vlite.worker.input_batch.ModelInputs`
#: and :class:`~vlite.core.attention.AttentionMetadata`). ``block_tables`` is kept flat and
#: viewed as ``[num_seqs, width]`` per step, so that a step's table is contiguous.
BUFFER_DTYPES: dict[str, torch.dtype] = {
    "input_ids": torch.int64,
    "positions": torch.int64,
    "slot_mapping": torch.int64,
    "context_lens_at_cache_start": torch.int64,
    "query_start_loc": torch.int32,
    "seq_lens": torch.int32,
    "block_tables": torch.int32,
    "logits_indices": torch.int64,
}

#: Elements a buffer holds before a step first needs more.
INITIAL_CAPACITY = 256


class InputBuffers:
    """The named buffers of :data:`BUFFER_DTYPES` for one worker's steps on ``device``.

    Per step: :meth:`begin`, then for each buffer :meth:`host` (fill it) and
    :meth:`upload` (the device tensor to hand the model), then :meth:`end`.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._pinned = device.type == "cuda"
        self._host: dict[str, torch.Tensor] = {}
        self._device: dict[str, torch.Tensor] = {}
        self._host_arrays: dict[str, np.ndarray] = {}
        #: Recorded once a step's copies to the device are queued (GPU only).
        self._copied: torch.cuda.Event | None = None
        for name in BUFFER_DTYPES:
            self._allocate(name, INITIAL_CAPACITY)

    def capacity(self, name: str) -> int:
        """Elements buffer ``name`` holds now."""
        return self._host[name].numel()

    def begin(self) -> None:
        """Start a step: wait until the last step's copies have read the host side."""
        if self._copied is not None:
            self._copied.synchronize()
            self._copied = None

    def host(self, name: str, count: int) -> np.ndarray:
        """The first ``count`` elements of buffer ``name``'s host side, to write (grown
        first if it holds fewer; what it held is then lost)."""
        if count > self.capacity(name):
            self._allocate(name, max(count, 2 * self.capacity(name)))
        return self._host_arrays[name][:count]

    def upload(self, name: str, count: int, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        """The device tensor of the first ``count`` elements of buffer ``name`` (viewed as
        ``shape``), with what :meth:`host` wrote there."""
        host = self._host[name][:count]
        if self.device.type == "cpu":
            tensor = host
        else:
            tensor = self._device[name][:count]
            tensor.copy_(host, non_blocking=True)
        return tensor if shape is None else tensor.view(shape)

    def end(self) -> None:
        """The step's copies are queued: the next :meth:`begin` waits for them."""
        if self.device.type == "cuda":
            self._copied = torch.cuda.Event()
            self._copied.record()

    def _allocate(self, name: str, capacity: int) -> None:
        dtype = BUFFER_DTYPES[name]
        host = torch.zeros(capacity, dtype=dtype, pin_memory=self._pinned)
        self._host[name] = host
        self._host_arrays[name] = host.numpy()
        if self.device.type != "cpu":
            self._device[name] = torch.zeros(capacity, dtype=dtype, device=self.device)
