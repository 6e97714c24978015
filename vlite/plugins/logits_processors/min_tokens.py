"""``min_tokens``: EOS and ``stop_token_ids`` cannot be sampled before ``min_tokens``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from vlite.core.logits_processor import AddedRequest
from vlite.core.sampling_params import SamplingParams
from vlite.plugins.logits_processors.per_request import (
    PerRequestLogitsProcessor,
    in_vocab,
    set_to_minus_inf,
)


@dataclass(frozen=True)
class MinTokens:
    """One request's stop tokens and how long they stay banned.

    Attributes:
        min_tokens: output tokens before ``stop_ids`` may be sampled.
        stop_ids: its ``stop_token_ids`` and EOS (unless ``ignore_eos``), in the vocabulary.
        token_ids: the request's live token list, prompt first.
        num_prompt_tokens: how many of ``token_ids`` are the prompt.
    """

    min_tokens: int
    stop_ids: list[int]
    token_ids: list[int]
    num_prompt_tokens: int

    def is_due(self, ahead: int = 0) -> bool:
        """Whether the output, with ``ahead`` tokens more, is still shorter than
        ``min_tokens``."""
        return len(self.token_ids) - self.num_prompt_tokens + ahead < self.min_tokens


class MinTokensLogitsProcessor(PerRequestLogitsProcessor[MinTokens]):
    """Sets a row's EOS (unless ``ignore_eos``) and ``stop_token_ids`` to ``-inf`` while its
    request has fewer than ``min_tokens`` output tokens (vLLM's rule). Stop ids outside the
    vocabulary (tokens the model cannot produce) are ignored. A row that follows drafts
    counts them as output."""

    follows_drafts = True

    #: Requests that use it (for ``LogitsProcessorConformance``).
    active_params: ClassVar[list[SamplingParams]] = [
        SamplingParams(min_tokens=3, stop_token_ids=[6]),
        SamplingParams(min_tokens=2, ignore_eos=True, stop_token_ids=[8, 5000]),
    ]

    def request_state(self, request: AddedRequest) -> MinTokens | None:
        params = request.params
        if not params.min_tokens:
            return None
        stop_ids = list(params.stop_token_ids or ())
        if request.eos_token_id is not None and not params.ignore_eos:
            stop_ids.append(request.eos_token_id)
        stop_ids = in_vocab(stop_ids, self.vocab_size)
        if not stop_ids:
            return None
        return MinTokens(params.min_tokens, stop_ids, request.token_ids, request.num_prompt_tokens)

    def edit_rows(self, logits: torch.Tensor) -> torch.Tensor:
        pairs = []
        for row, state in self.active:
            if state.is_due(len(self.drafts_before_row(row))):
                pairs += [(row, token) for token in state.stop_ids]
        if not pairs:
            return logits
        return set_to_minus_inf(logits, pairs)
