"""Keep freed memory for reuse instead of handing it back to the OS after every op.

A prefill of a few thousand tokens allocates activations of tens of megabytes per op
(the default model's gate/up product for 4,352 tokens is 53 MB). glibc serves allocations
that large with a fresh ``mmap`` and unmaps them on free, so every such op first takes a
page fault per 4 KiB of its output: 17 ms of the kernel zeroing pages for that one 53 MB
tensor, on this project's development machine, against 0.7 ms to write it once mapped. On
the batched benchmark that was about a seventh of the wall time.

:func:`reuse_freed_memory` tells glibc's allocator (``mallopt``) to serve every
allocation from its heap and to keep up to :data:`KEPT_FREE_BYTES` of freed memory at the
heap's top: later steps reuse the pages of earlier ones. The price: the resident size
stays near its peak instead of shrinking between steps, and freed blocks that do not fit
the next request exactly may be held a while (the batched benchmark's peak resident size
was the same with and without the setting, 2.9 GB, most of it the KV cache). Workers on
the CPU call it at start; other C libraries are left alone.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import math
import mmap
import os
import warnings

import torch

#: glibc's ``mallopt`` parameter numbers (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4

#: Free memory at the heap's top kept for reuse, in bytes (the rest goes back to the OS).
KEPT_FREE_BYTES = 1 << 30


def _glibc() -> ctypes.CDLL | None:
    """The running glibc, or None where the C library is another one."""
    try:
        if not os.confstr("CS_GNU_LIBC_VERSION"):
            return None
    except (AttributeError, ValueError, OSError):
        return None
    name = ctypes.util.find_library("c") or "libc.so.6"
    try:
        return ctypes.CDLL(name)
    except OSError:
        return None


def reuse_freed_memory() -> bool:
    """Make glibc keep freed memory for reuse; returns whether the settings took."""
    libc = _glibc()
    if libc is None or not hasattr(libc, "mallopt"):
        return False
    kept = libc.mallopt(_M_TRIM_THRESHOLD, KEPT_FREE_BYTES)
    heap_only = libc.mallopt(_M_MMAP_MAX, 0)
    return bool(kept and heap_only)


def lazily_zeroed(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of zeros in its own anonymous memory mapping.

    The OS hands out a mapping's pages, zeroed, when they are first touched, so a KV
    cache allocated this way is resident only as far as its blocks have been written: the
    2 GiB that ``LLM()`` reserves by default cost the memory of the blocks in use (a
    ``torch.zeros`` of it writes every page at once). The tensor keeps the mapping alive.
    """
    numel = math.prod(shape)
    nbytes = numel * dtype.itemsize
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with warnings.catch_warnings():  # "the buffer is not writable": it is (a private map)
        warnings.simplefilter("ignore", UserWarning)
        flat = torch.frombuffer(mapping, dtype=torch.uint8)
    return flat.view(dtype).view(shape)
