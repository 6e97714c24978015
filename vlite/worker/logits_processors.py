"""The model runner's logits processors: every registered one, run on each step's logits.

The runner reports requests as they arrive (:meth:`LogitsProcessorPipeline.add_request`)
and finish (:meth:`~LogitsProcessorPipeline.remove_request`); the pipeline hands the
changes gathered since the last sampled step to each processor, with the step's rows, just
before the processors edit the logits (see :mod:`vlite.core.logits_processor`).
"""

from __future__ import annotations

from typing import Any

import torch

from vlite.core.logits_processor import AddedRequest, BatchUpdate, LogitsProcessor
from vlite.core.plugins import PluginRegistry

#: The plugin kind of logits processors (a key of ``vlite.core.plugins.PLUGIN_KINDS``).
KIND = "logits_processor"


class LogitsProcessorPipeline:
    """Logits processors in registry order, and the batch changes they have not seen yet.

    Args:
        processors: the instances, applied in this order.
    """

    def __init__(self, processors: list[LogitsProcessor]) -> None:
        self.processors = list(processors)
        self._added: dict[str, AddedRequest] = {}
        self._removed: dict[str, None] = {}  # an ordered set

    @classmethod
    def from_registry(
        cls, registry: PluginRegistry, config: Any, device: torch.device, vocab_size: int
    ) -> LogitsProcessorPipeline:
        """Every registered ``logits_processor``, in registration order (vlite's built-ins
        first), each constructed as ``cls(config, device, vocab_size)``."""
        entries = [entry for entry in registry.entries() if entry.kind == KIND]
        return cls([entry.obj(config, device, vocab_size) for entry in entries])

    @property
    def has_pending_changes(self) -> bool:
        """Whether requests arrived or finished since the processors last heard."""
        return bool(self._added or self._removed)

    def add_request(self, request: AddedRequest) -> None:
        """Note a request the worker sees for the first time."""
        if self.processors:
            self._added[request.request_id] = request

    def remove_request(self, request_id: str) -> None:
        """Note a request that finished or was aborted; one that arrived since the last
        step is simply dropped from the arrivals."""
        if self.processors:
            self._added.pop(request_id, None)
            self._removed[request_id] = None

    def update_state(self, rows: list[str], drafts_before: list[list[int]] | None = None) -> None:
        """Give each processor the pending changes, this step's ``rows`` (the request of
        each logits row) and the drafts each row follows (``None``: none); the changes are
        then no longer pending."""
        update = BatchUpdate(
            list(self._added.values()), list(self._removed), rows, drafts_before or []
        )
        self._added, self._removed = {}, {}
        for processor in self.processors:
            processor.update_state(update)

    def apply(
        self, logits: torch.Tensor, rows: list[str], drafts_before: list[list[int]] | None = None
    ) -> torch.Tensor:
        """Run every processor on ``logits`` (``[len(rows), vocab_size]``; ``drafts_before``
        as :attr:`BatchUpdate.drafts_before`); returns the edited logits (the same tensor,
        unless a processor returned another)."""
        self.update_state(rows, drafts_before)
        for processor in self.processors:
            logits = processor.apply(logits)
        return logits
