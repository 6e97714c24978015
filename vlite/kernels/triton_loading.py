"""Import Triton kernel modules compiled or interpreted, decided before they are defined.

``@triton.jit`` picks compiled or interpreted execution when a kernel is *defined*, from
``TRITON_INTERPRET``; so the choice must be made before a kernel module is imported.
:func:`load_kernel_modules` makes it for a group of kernel modules (the triton attention
backend's, the mixture-of-experts layer's):

- compiled: the modules are imported as usual (interpreted anyway if the user set
  ``TRITON_INTERPRET=1``);
- interpreted, without a CUDA device: the process is switched to the interpreter
  (``TRITON_INTERPRET=1`` is set, with one warning) before the modules are imported;
- interpreted, with a CUDA device (CPU tensors in a GPU process), or when the modules were
  already imported compiled: a private copy of each module is defined with
  ``TRITON_INTERPRET=1`` set only meanwhile, so the process's compiled kernels stay as
  they are.

Nothing is set at ``import vlite``: only a process that runs Triton kernels on a CPU-only
machine is switched to the interpreter. This module does not import ``triton``.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import warnings
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import TypeVar

import torch

INTERPRET_ENV = "TRITON_INTERPRET"
T = TypeVar("T")


class TritonInterpreterWarning(UserWarning):
    """Triton kernels run under the Triton interpreter (slow; for correctness)."""


def runs_interpreted(device: torch.device | str) -> bool:
    """Whether kernels for tensors on ``device`` run interpreted: they do on any device but
    CUDA, and everywhere when the user set ``TRITON_INTERPRET=1``."""
    return torch.device(device).type != "cuda" or os.environ.get(INTERPRET_ENV) == "1"


def defines_interpreted_kernels(module: ModuleType) -> bool:
    """Whether ``module``'s ``@triton.jit`` functions were defined for the interpreter."""
    return any(type(value).__name__ == "InterpretedFunction" for value in vars(module).values())


def load_once_per_mode(
    cache: dict[bool, T],
    device: torch.device | str,
    name: str,
    user: str,
    alternative: str,
    make: Callable[[ModuleType], T],
) -> T:
    """``make(module)`` for the kernel module ``name`` in the mode tensors on ``device``
    need (:func:`runs_interpreted`), built once per mode and kept in ``cache``; ``user`` and
    ``alternative`` as for :func:`load_kernel_modules`."""
    interpreted = runs_interpreted(device)
    loaded = cache.get(interpreted)
    if loaded is None:
        (module,) = load_kernel_modules((name,), interpreted, user, alternative)
        loaded = cache[interpreted] = make(module)
    return loaded


def load_kernel_modules(
    names: Sequence[str], interpreted: bool, user: str, alternative: str
) -> list[ModuleType]:
    """The kernel modules ``names`` (full module names), defined for the wanted mode.

    Args:
        names: modules that import ``triton`` and define ``@triton.jit`` kernels; a private
            copy is named ``<package>._interpreted_<module>``.
        interpreted: whether the kernels must run under the interpreter (see
            :func:`runs_interpreted`).
        user: who runs them, for messages (``"the triton attention backend"``).
        alternative: what to do instead without ``triton``, for the ``ImportError``.

    Returns:
        The modules, in the order of ``names``.

    Raises:
        ImportError: ``triton`` is not installed.
    """
    if importlib.util.find_spec("triton") is None:
        raise ImportError(
            f"{user} needs the triton package: install it with `pip install triton`, "
            f"or {alternative}"
        )
    if interpreted and not torch.cuda.is_available():
        _enable_interpreter(user)
    modules = [importlib.import_module(name) for name in names]
    if interpreted and not all(defines_interpreted_kernels(module) for module in modules):
        # CUDA is present (or the modules were imported before the switch): keep them
        # compiled and interpret private copies.
        modules = _load_interpreted_copies(names, user)
    return modules


def _load_interpreted_copies(names: Sequence[str], user: str) -> list[ModuleType]:
    """Fresh copies of the modules ``names``, defined with ``TRITON_INTERPRET=1``."""
    warnings.warn(
        f"{user} got CPU tensors in a process with CUDA: it runs an interpreted copy of its "
        "kernels on CPU, for correctness, not speed",
        TritonInterpreterWarning,
        stacklevel=4,
    )
    previous = os.environ.get(INTERPRET_ENV)
    os.environ[INTERPRET_ENV] = "1"
    try:
        return [_load_copy(name) for name in names]
    finally:
        if previous is None:
            del os.environ[INTERPRET_ENV]
        else:
            os.environ[INTERPRET_ENV] = previous


def _load_copy(name: str) -> ModuleType:
    package, _, leaf = name.rpartition(".")
    path = importlib.util.find_spec(name).origin
    spec = importlib.util.spec_from_file_location(f"{package}._interpreted_{leaf}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # for inspect, which reads the kernels' source
    spec.loader.exec_module(module)
    return module


def _enable_interpreter(user: str) -> None:
    if os.environ.get(INTERPRET_ENV) == "1":
        return  # set by the user (or by us before): nothing to announce
    triton_was_imported = "triton" in sys.modules
    os.environ[INTERPRET_ENV] = "1"
    message = (
        f"no CUDA device: {user} runs its kernels under the Triton interpreter on CPU "
        f"({INTERPRET_ENV}=1 set now), for correctness, not speed"
    )
    if triton_was_imported:
        # Usual: torch._dynamo imports triton. Triton's own @jit library then stays
        # compiled; vlite's kernels do not call it.
        message += (
            f" (triton was already imported without {INTERPRET_ENV}=1: only vlite's "
            "kernels are interpreted)"
        )
    warnings.warn(message, TritonInterpreterWarning, stacklevel=4)
