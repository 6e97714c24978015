"""Triton kernels of the ``triton`` attention backend.

- :mod:`.write_kv`: new keys/values into the paged cache by slot mapping;
- :mod:`.paged_attention`: one kernel for batches mixing prefill chunks and decodes over
  the paged cache (online softmax, causal, grouped-query), with split-K and its reduce;
- :mod:`.config`: tile sizes and the split-K heuristic (pure Python).

Importing this package imports neither ``triton`` nor the kernels: :func:`load_kernels`
does, once per mode, after deciding how they run. ``@triton.jit`` picks compiled or
interpreted execution when a kernel is *defined*, from ``TRITON_INTERPRET``; so without a
CUDA device :func:`load_kernels` sets ``TRITON_INTERPRET=1`` before the kernel modules are
imported, and warns once that this path is for correctness, not speed. Nothing is set at
``import vlite``: only a process that uses the triton backend on a CPU-only machine is
switched to the interpreter.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

INTERPRET_ENV = "TRITON_INTERPRET"


class TritonInterpreterWarning(UserWarning):
    """The triton backend runs under the Triton interpreter (slow; for correctness)."""


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
    interpreted = torch.device(device).type != "cuda" or os.environ.get(INTERPRET_ENV) == "1"
    kernels = _loaded.get(interpreted)
    if kernels is None:
        kernels = _loaded[interpreted] = _import_kernels(interpreted)
    return kernels


def _import_kernels(interpreted: bool) -> TritonKernels:
    if importlib.util.find_spec("triton") is None:
        raise ImportError(
            "the triton attention backend needs the triton package: install it with "
            "`pip install triton`, or choose another backend (--attn torch)"
        )
    if interpreted and not torch.cuda.is_available():
        _enable_interpreter()
    from vlite.plugins.attention.triton_kernels import paged_attention, write_kv

    if interpreted and not paged_attention.is_interpreted():
        # CUDA is present (or the modules were imported before the switch): keep them
        # compiled and interpret a private copy.
        write_kv, paged_attention = _load_interpreted_copy()
    return TritonKernels(
        write_kv=write_kv.write_kv,
        paged_attention=paged_attention.paged_attention,
        new_workspace=paged_attention.SplitWorkspace,
        interpreted=paged_attention.is_interpreted(),
    )


def _load_interpreted_copy() -> tuple[ModuleType, ModuleType]:
    """Fresh copies of the kernel modules, defined with ``TRITON_INTERPRET=1``.

    Returns:
        ``(write_kv, paged_attention)`` copies, under private module names.
    """
    warnings.warn(
        "the triton attention backend got CPU tensors in a process with CUDA: it runs an "
        "interpreted copy of its kernels on CPU, for correctness, not speed",
        TritonInterpreterWarning,
        stacklevel=4,
    )
    previous = os.environ.get(INTERPRET_ENV)
    os.environ[INTERPRET_ENV] = "1"
    try:
        return _load_copy("write_kv"), _load_copy("paged_attention")
    finally:
        if previous is None:
            del os.environ[INTERPRET_ENV]
        else:
            os.environ[INTERPRET_ENV] = previous


def _load_copy(name: str) -> ModuleType:
    path = Path(__file__).with_name(f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"{__name__}._interpreted_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # for inspect, which reads the kernels' source
    spec.loader.exec_module(module)
    return module


def _enable_interpreter() -> None:
    if os.environ.get(INTERPRET_ENV) == "1":
        return  # set by the user (or by us before): nothing to announce
    triton_was_imported = "triton" in sys.modules
    os.environ[INTERPRET_ENV] = "1"
    message = (
        "no CUDA device: the triton attention backend runs its kernels under the Triton "
        f"interpreter on CPU ({INTERPRET_ENV}=1 set now), for correctness, not speed"
    )
    if triton_was_imported:
        # Usual: torch._dynamo imports triton. Triton's own @jit library then stays
        # compiled; vlite's kernels do not call it.
        message += (
            f" (triton was already imported without {INTERPRET_ENV}=1: only vlite's "
            "kernels are interpreted)"
        )
    warnings.warn(message, TritonInterpreterWarning, stacklevel=4)
