"""A logits processor a request selects: no n-gram twice in its output.

``SamplingParams(extra_args={"no_repeat_ngram_size": n})`` bans, at each step, every token
that would complete an ``n``-token sequence the output already holds (``n = 1``: no token
twice). Requests without the key are left alone, at no cost: vlite's
``PerRequestLogitsProcessor`` keeps a state only for the requests that use it, and returns
the logits untouched on a step where none of its rows does.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from vlite.core.logits_processor import AddedRequest
from vlite.core.sampling_params import SamplingParams
from vlite.plugins.logits_processors.per_request import (
    PerRequestLogitsProcessor,
    set_to_minus_inf,
)

#: The ``extra_args`` key a request sets to use the processor.
KEY = "no_repeat_ngram_size"


class NoRepeatNgram(PerRequestLogitsProcessor[tuple[int, AddedRequest]]):
    """Bans the tokens that would repeat an n-gram of the output."""

    #: Requests that use it (for ``LogitsProcessorConformance``).
    active_params: ClassVar[list[SamplingParams]] = [
        SamplingParams(extra_args={KEY: 1}),
        SamplingParams(extra_args={KEY: 2}),
    ]

    def request_state(self, request: AddedRequest) -> tuple[int, AddedRequest] | None:
        size = (request.params.extra_args or {}).get(KEY)
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            return None
        return size, request

    def edit_rows(self, logits: torch.Tensor) -> torch.Tensor:
        pairs = [
            (row, token)
            for row, (size, request) in self.active
            for token in banned_tokens(request.token_ids[request.num_prompt_tokens :], size)
            if token < self.vocab_size
        ]
        return set_to_minus_inf(logits, pairs) if pairs else logits


def banned_tokens(output: list[int], size: int) -> set[int]:
    """The tokens that would complete an already seen ``size``-gram of ``output``."""
    prefix = output[len(output) - size + 1 :] if size > 1 else []
    if len(prefix) != size - 1:
        return set()
    return {
        output[start + size - 1]
        for start in range(len(output) - size + 1)
        if output[start : start + size - 1] == prefix
    }
