"""``allowed_token_ids``: only the listed tokens of a request may be sampled."""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from vlite.core.logits_processor import AddedRequest
from vlite.core.sampling_params import SamplingParams
from vlite.plugins.logits_processors.per_request import (
    PerRequestLogitsProcessor,
    in_vocab,
    rows_and_columns,
)


class AllowedTokenIdsLogitsProcessor(PerRequestLogitsProcessor[list[int]]):
    """Sets every logit of a row to ``-inf`` except those of its ``allowed_token_ids``.

    Ids outside the vocabulary are ignored; a request none of whose ids is in it is left
    unconstrained (masking the whole row would leave the sampler nothing to draw; the front
    end refuses such requests). The ``[active rows, vocab_size]`` mask is built when the
    step's constrained rows change, and reused while they do not.
    """

    follows_drafts = True  # its edit of a row does not read the tokens before it

    #: Requests that use it (for ``LogitsProcessorConformance``).
    active_params: ClassVar[list[SamplingParams]] = [
        SamplingParams(allowed_token_ids=[1, 5, 9, 5000]),
        SamplingParams(allowed_token_ids=[0]),
    ]

    def __init__(self, config: Any, device: torch.device, vocab_size: int) -> None:
        super().__init__(config, device, vocab_size)
        self._rows: torch.Tensor | None = None
        self._banned: torch.Tensor | None = None

    def request_state(self, request: AddedRequest) -> list[int] | None:
        allowed = in_vocab(request.params.allowed_token_ids or (), self.vocab_size)
        return allowed or None

    def edit_rows(self, logits: torch.Tensor) -> torch.Tensor:
        if self.active_changed or self._banned is None:
            self._rows, self._banned = self._build_mask(logits.device)
        rows = self._rows
        logits[rows] = logits[rows].masked_fill(self._banned, float("-inf"))
        return logits

    def _build_mask(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rows, banned)``: ``[m]`` int64 active rows and ``[m, vocab_size]`` bool, true
        for the tokens each may not take."""
        pairs = [(index, t) for index, (_, allowed) in enumerate(self.active) for t in allowed]
        banned = torch.ones(len(self.active), self.vocab_size, dtype=torch.bool, device=device)
        banned[rows_and_columns(pairs, device)] = False
        rows = [row for row, _ in self.active]
        return torch.tensor(rows, dtype=torch.int64).to(device), banned
