"""PerRequestLogitsProcessor: the bookkeeping every built-in processor shares.

A built-in's edit of a row depends only on that row's request, so each keeps one small
state per request that uses it, keyed by request id, and learns each step which rows
belong to those requests. A step in which no row uses the processor does no tensor work:
:meth:`~PerRequestLogitsProcessor.apply` returns the logits as they came.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import Any, Generic, TypeVar

import torch

from vlite.core.logits_processor import AddedRequest, BatchUpdate, LogitsProcessor

State = TypeVar("State")


class PerRequestLogitsProcessor(LogitsProcessor, Generic[State]):
    """A processor with one ``State`` per request that uses it.

    Subclasses implement :meth:`request_state` (``None`` for a request that does not use
    the processor) and :meth:`edit_rows`.

    Attributes:
        states: request id -> state, for the requests that use it.
        active: ``(row, state)`` of this step's rows that use it, in row order.
        active_changed: whether ``active`` may have changed since :meth:`edit_rows` last
            ran (a subclass that caches tensors built from ``active`` rebuilds them then).
    """

    def __init__(self, config: Any, device: torch.device, vocab_size: int) -> None:
        super().__init__(config, device, vocab_size)
        self.states: dict[str, State] = {}
        self.active: list[tuple[int, State]] = []
        #: The drafts each row of this step follows (:attr:`BatchUpdate.drafts_before`).
        self.drafts_before: list[list[int]] = []
        self.active_changed = True
        self._active_key: tuple[tuple[int, str], ...] = ()

    @abstractmethod
    def request_state(self, request: AddedRequest) -> State | None:
        """What the processor keeps for ``request``; ``None`` if it does not apply to it."""

    @abstractmethod
    def edit_rows(self, logits: torch.Tensor) -> torch.Tensor:
        """Edit the :attr:`active` rows of ``logits`` (``[rows, vocab_size]``; at least one
        row is active) and return them."""

    def update_state(self, batch_update: BatchUpdate) -> None:
        """Forget the removed requests, learn the added ones, and find this step's rows
        (O(changes) when no request uses the processor, else O(changes + rows))."""
        self.drafts_before = batch_update.drafts_before
        changed = False
        for request_id in batch_update.removed:
            changed |= self.states.pop(request_id, None) is not None
        for request in batch_update.added:
            state = self.request_state(request)
            if state is not None:
                self.states[request.request_id] = state
                changed = True
            else:  # an id reused without being removed first: forget the old request
                changed |= self.states.pop(request.request_id, None) is not None
        key: tuple[tuple[int, str], ...] = ()
        if self.states:
            states = self.states
            key = tuple((row, rid) for row, rid in enumerate(batch_update.rows) if rid in states)
        if changed or key != self._active_key:
            self._active_key = key
            self.active = [(row, self.states[request_id]) for row, request_id in key]
            self.active_changed = True

    def drafts_before_row(self, row: int) -> list[int]:
        """The draft tokens row ``row`` of this step follows (``[]`` for none)."""
        return self.drafts_before[row] if self.drafts_before else []

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits`` untouched when no row uses the processor, else :meth:`edit_rows`."""
        if not self.active:
            return logits
        logits = self.edit_rows(logits)
        self.active_changed = False
        return logits


def in_vocab(token_ids: Any, vocab_size: int) -> list[int]:
    """The distinct ids of ``token_ids`` that are in ``[0, vocab_size)``, in first-seen
    order (an id the model cannot produce is ignored, not an error: the front end rejects
    them)."""
    return list(dict.fromkeys(t for t in token_ids if 0 <= t < vocab_size))


def rows_and_columns(
    pairs: list[tuple[int, int]], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rows, columns)``, both ``[len(pairs)]`` int64 on ``device``, of ``(row, token)``
    pairs: an index for ``logits[rows, columns]``."""
    table = torch.tensor(pairs, dtype=torch.int64).reshape(-1, 2).to(device, non_blocking=True)
    return table[:, 0], table[:, 1]


def set_to_minus_inf(logits: torch.Tensor, pairs: list[tuple[int, int]]) -> torch.Tensor:
    """``logits`` with ``logits[row, token] = -inf`` for each ``(row, token)`` of ``pairs``
    (in place; one indexed write)."""
    minus_inf = torch.tensor(float("-inf"), dtype=logits.dtype, device=logits.device)
    return logits.index_put_(rows_and_columns(pairs, logits.device), minus_inf)
