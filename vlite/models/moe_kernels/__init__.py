"""Triton kernels of the mixture-of-experts layer (:class:`~vlite.models.fused_moe.FusedMoE`).

- :mod:`.align`: the step's (token, expert) pairs grouped by expert into blocks (torch);
- :mod:`.grouped_gemm`: the grouped-GEMM kernel and its launcher (Triton);
- :mod:`.experts`: a layer's experts from the two (align, gated launch, weighted launch,
  per-token sum);
- :mod:`.config`: tile sizes (pure Python).

Importing this package imports neither ``triton`` nor the kernel: :func:`load_moe_kernels`
does, once per mode, through :func:`vlite.kernels.triton_loading.load_kernel_modules`:
compiled for CUDA tensors; interpreted for CPU tensors (without a CUDA device the process is
switched to the interpreter, ``TRITON_INTERPRET=1``, with one warning; with one, a private
interpreted copy is loaded).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from vlite.kernels.triton_loading import load_once_per_mode


@dataclass(frozen=True)
class MoEKernels:
    """The loaded launcher.

    Attributes:
        grouped_gemm: :func:`.grouped_gemm.grouped_gemm`.
        interpreted: whether it runs under the Triton interpreter (on CPU tensors).
    """

    grouped_gemm: Any
    interpreted: bool


#: Loaded kernels by "interpreted?".
_loaded: dict[bool, MoEKernels] = {}


def load_moe_kernels(device: torch.device | str) -> MoEKernels:
    """The kernels for tensors on ``device``: compiled on CUDA (unless ``TRITON_INTERPRET=1``
    is set), interpreted elsewhere; imported once per mode.

    Raises:
        ImportError: ``triton`` is not installed.
    """
    return load_once_per_mode(
        _loaded,
        device,
        f"{__name__}.grouped_gemm",
        user="the triton MoE implementation",
        alternative="set VLITE_MOE_IMPL=torch",
        make=lambda module: MoEKernels(module.grouped_gemm, module.is_interpreted()),
    )
