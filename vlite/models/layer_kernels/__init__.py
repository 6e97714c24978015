"""Triton versions of the layers' fused elementwise steps, for CUDA tensors.

On a GPU a decode step of a small model is a few hundred kernels, most of them tiny: an
RMSNorm written in PyTorch ops is nine (add, cast, square, mean, add, rsqrt, multiply, cast,
multiply), RoPE seven, SwiGLU's activation two. :class:`TritonFusedOps` does each in one
kernel, with the interface of the CPU's C kernels (:class:`vlite.kernels.native.FusedOps`),
so the layers call either the same way (``module.native``). Every intermediate is rounded
to the tensors' dtype where PyTorch's ops round it: under the interpreter float16 results
equal PyTorch's bit for bit; compiled on an H100, a few values of RoPE in bfloat16 and
float16 differed by one unit in the last place.

Importing this package imports neither ``triton`` nor the kernels: :func:`load_fused_ops`
does, once per mode, through :func:`vlite.kernels.triton_loading.load_kernel_modules`
(compiled for CUDA tensors, interpreted for CPU tensors, as the tests run them).
"""

from __future__ import annotations

import torch

from vlite.kernels.triton_loading import load_once_per_mode

#: Loaded ops by "interpreted?".
_loaded: dict[bool, object] = {}


def load_fused_ops(device: torch.device | str):
    """The :class:`~.fused_ops.TritonFusedOps` for tensors on ``device``: compiled on CUDA
    (unless ``TRITON_INTERPRET=1`` is set), interpreted elsewhere; imported once per mode.

    Raises:
        ImportError: ``triton`` is not installed.
    """
    return load_once_per_mode(
        _loaded,
        device,
        f"{__name__}.fused_ops",
        user="the fused-layer-ops module",
        alternative="run on CUDA",
        make=lambda module: module.TritonFusedOps(module.is_interpreted()),
    )
