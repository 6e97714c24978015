"""Triton kernels of the ``triton`` attention backend.

- :mod:`.write_kv`: new keys/values into the paged cache by slot mapping;
- :mod:`.paged_attention`: one kernel for batches mixing prefill chunks and decodes over
  the paged cache (online softmax, causal, grouped-query), with split-K and its reduce;
- :mod:`.config`: tile sizes and the split-K heuristic (pure Python).

Importing this package imports neither ``triton`` nor the kernels: :func:`load_kernels`
does, once per mode, through :func:`vlite.kernels.triton_loading.load_kernel_modules`,
after deciding how they run. ``@triton.jit`` picks compiled or interpreted execution when
a kernel is *defined*, from ``TRITON_INTERPRET``; so without a CUDA device
``TRITON_INTERPRET=1`` is set before the kernel modules are imported, with one warning
that this path is for correctness, not speed. Nothing is set at ``import vlite``: only a
process that uses the triton backend on a CPU-only machine is switched to the interpreter.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from vlite.kernels.triton_loading import load_kernel_modules, runs_interpreted


@dataclass(frozen=True)
class TritonKernels:
    """The kernel launchers, loaded by :func:`load_kernels`.

    Attributes:
        write_kv: :func:`.write_kv.write_kv`.
        paged_attention: :func:`.paged_attention.paged_attention`.
        new_workspace: makes a :class:`.paged_attention.SplitWorkspace`.
        interpreted: whether the kernels run under the Triton interpreter (on CPU tensors).
    """

    write_kv: Any
    paged_attention: Any
    new_workspace: Any
    interpreted: bool


#: Loaded kernels by "interpreted?".
_loaded: dict[bool, TritonKernels] = {}


def load_kernels(device: torch.device | str | None = None) -> TritonKernels:
    """The kernels for tensors on ``device``, imported once per mode.

    - CUDA tensors get the compiled kernels (interpreted if ``TRITON_INTERPRET=1`` is set).
    - CPU tensors get interpreted kernels. Without a CUDA device the process is switched to
      the interpreter: ``TRITON_INTERPRET=1`` is set (with one warning) before the kernel
      modules are imported. With a CUDA device (CPU tensors in a GPU process, as in the
      conformance suite's CPU cases) a private interpreted copy of the kernel modules is
      loaded instead, with ``TRITON_INTERPRET=1`` set only while it is defined, so the
      process's compiled kernels are unaffected.

    Args:
        device: where the tensors live; default: CUDA if present, else CPU.

    Raises:
        ImportError: ``triton`` is not installed.
    """
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    interpreted = runs_interpreted(device)
    kernels = _loaded.get(interpreted)
    if kernels is None:
        kernels = _loaded[interpreted] = _import_kernels(interpreted)
    return kernels


def _import_kernels(interpreted: bool) -> TritonKernels:
    write_kv, paged_attention = load_kernel_modules(
        (f"{__name__}.write_kv", f"{__name__}.paged_attention"),
        interpreted,
        user="the triton attention backend",
        alternative="choose another backend (--attn torch)",
    )
    return TritonKernels(
        write_kv=write_kv.write_kv,
        paged_attention=paged_attention.paged_attention,
        new_workspace=paged_attention.SplitWorkspace,
        interpreted=paged_attention.is_interpreted(),
    )
