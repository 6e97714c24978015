"""A test-only model plugin that fails on demand, wherever its worker runs.

:class:`FaultInjectingCausalLM` is the Llama-family model with one change: a forward pass
whose batch contains the *fault token* fails, either by raising :class:`InjectedFault` or by
ending its process at once (``os._exit``), as a crashed worker would. The fault is chosen by
the model folder's ``config.json`` (written by :func:`make_faulty_model`), so it behaves the
same in an in-process worker and in worker processes, without monkeypatching.

Register this module as a plugin (``build_plugin_manager(extra_plugins=(faults,))``) to
make the architecture available; executors hand the registry they were given to their
workers.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from vlite.core.hookspecs import Register, hookimpl
from vlite.models.llama import LlamaForCausalLM

FAULTY_ARCHITECTURE = "VliteFaultInjectingForCausalLM"
#: Appears in the message of every injected exception.
FAULT_MARKER = "VLITE_INJECTED_FAULT"
FAULT_MODES = ("raise", "exit")
EXIT_CODE = 86


class InjectedFault(RuntimeError):
    """The exception a fault-injecting model raises."""


class FaultInjectingCausalLM(LlamaForCausalLM):
    """A Llama model whose forward fails when its batch holds ``vlite_fault_token_id``.

    It never generates the fault token itself (its logit is ``-inf``), so only a prompt
    that contains it triggers the fault.

    ``config.json`` fields: ``vlite_fault_token_id`` (int) and ``vlite_fault_mode``
    (``"raise"``: raise :class:`InjectedFault`; ``"exit"``: end the process with
    :data:`EXIT_CODE`).
    """

    def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, *args, **kwargs)
        self.fault_token_id = int(config.vlite_fault_token_id)
        self.fault_mode = config.vlite_fault_mode
        if self.fault_mode not in FAULT_MODES:
            raise ValueError(f"vlite_fault_mode={self.fault_mode!r}; expected one of {FAULT_MODES}")

    def forward(self, input_ids: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if bool((input_ids == self.fault_token_id).any()):
            if self.fault_mode == "exit":
                os._exit(EXIT_CODE)
            raise InjectedFault(
                f"{FAULT_MARKER}: the batch holds fault token {self.fault_token_id} "
                f"(process {os.getpid()})"
            )
        return super().forward(input_ids, *args, **kwargs)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden_states)
        logits[:, self.fault_token_id] = float("-inf")
        return logits


def make_faulty_model(folder: Path, model_folder: Path, fault_token_id: int, mode: str) -> Path:
    """Copy the tiny model in ``model_folder`` to ``folder`` as a fault-injecting one."""
    import shutil

    if mode not in FAULT_MODES:
        raise ValueError(f"mode={mode!r}; expected one of {FAULT_MODES}")
    folder = Path(folder)
    shutil.copytree(model_folder, folder, dirs_exist_ok=True)
    config_path = folder / "config.json"
    config = json.loads(config_path.read_text())
    config.update(
        architectures=[FAULTY_ARCHITECTURE],
        vlite_fault_token_id=fault_token_id,
        vlite_fault_mode=mode,
    )
    config_path.write_text(json.dumps(config, indent=2))
    return folder


@hookimpl
def register_models(register: Register) -> None:
    register(FAULTY_ARCHITECTURE, FaultInjectingCausalLM)
