"""``logit_bias``: add each request's ``SamplingParams.logit_bias`` to its row's logits."""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from vlite.core.logits_processor import AddedRequest
from vlite.core.sampling_params import SamplingParams
from vlite.plugins.logits_processors.per_request import (
    PerRequestLogitsProcessor,
    rows_and_columns,
)

#: One request's bias: ``(token_ids, biases)``, token ids in the vocabulary.
Bias = tuple[list[int], list[float]]


class LogitBiasLogitsProcessor(PerRequestLogitsProcessor[Bias]):
    """``logits[row, token] += bias`` for every ``token: bias`` of the row's request.

    Ids outside the vocabulary are ignored. The index and bias tensors are built when the
    step's rows that use a bias change, and reused while they do not.
    """

    follows_drafts = True  # its edit of a row does not read the tokens before it

    #: Requests that use it (for ``LogitsProcessorConformance``).
    active_params: ClassVar[list[SamplingParams]] = [
        SamplingParams(logit_bias={3: 5.0, 17: -100.0, 5000: 1.0}),
        SamplingParams(logit_bias={0: 100.0}),
    ]

    def __init__(self, config: Any, device: torch.device, vocab_size: int) -> None:
        super().__init__(config, device, vocab_size)
        self._index: tuple[torch.Tensor, torch.Tensor] | None = None
        self._values: torch.Tensor | None = None

    def request_state(self, request: AddedRequest) -> Bias | None:
        bias = request.params.logit_bias or {}
        kept = {t: b for t, b in bias.items() if 0 <= t < self.vocab_size}
        return (list(kept), list(kept.values())) if kept else None

    def edit_rows(self, logits: torch.Tensor) -> torch.Tensor:
        if self.active_changed or self._values is None or self._values.dtype != logits.dtype:
            pairs = [(row, t) for row, (ids, _) in self.active for t in ids]
            values = [b for _, (_, biases) in self.active for b in biases]
            self._index = rows_and_columns(pairs, logits.device)
            self._values = torch.tensor(values, dtype=logits.dtype).to(logits.device)
        return logits.index_put_(self._index, self._values, accumulate=True)
