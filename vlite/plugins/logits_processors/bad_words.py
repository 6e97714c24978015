"""``bad_words``: a request's output never contains one of its ``bad_words_token_ids``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from vlite.core.logits_processor import AddedRequest
from vlite.core.sampling_params import SamplingParams
from vlite.plugins.logits_processors.per_request import (
    PerRequestLogitsProcessor,
    set_to_minus_inf,
)


@dataclass(frozen=True)
class BadWords:
    """One request's banned words.

    Attributes:
        words: ``(prefix, last)`` per word: ``last`` (in the vocabulary) is banned where
            the output ends with ``prefix`` (always, for an empty prefix).
        token_ids: the request's live token list, prompt first.
        num_prompt_tokens: how many of ``token_ids`` are the prompt.
    """

    words: list[tuple[list[int], int]]
    token_ids: list[int]
    num_prompt_tokens: int

    def banned_now(self, drafts: list[int]) -> list[int]:
        """The tokens that would complete a bad word at the end of the output so far,
        followed by ``drafts``."""
        tokens = self.token_ids + drafts if drafts else self.token_ids
        num_output = len(tokens) - self.num_prompt_tokens
        banned = []
        for prefix, last in self.words:
            size = len(prefix)
            if size <= num_output and tokens[len(tokens) - size :] == prefix:
                banned.append(last)
        return banned


class BadWordsLogitsProcessor(PerRequestLogitsProcessor[BadWords]):
    """Sets to ``-inf`` the last token of each bad word whose other tokens end the output.

    vLLM's rule: only the output is looked at (a word may straddle the prompt's end); a
    one-token word is always banned; a word whose last token is outside the vocabulary is
    ignored. A row that follows drafts reads them after the output. Each step costs host
    work proportional to the words of the rows that use it, and one indexed write when a
    word is due.
    """

    follows_drafts = True

    #: Requests that use it (for ``LogitsProcessorConformance``).
    active_params: ClassVar[list[SamplingParams]] = [
        SamplingParams(bad_words_token_ids=[[7], [4, 5]]),
        SamplingParams(bad_words_token_ids=[[9, 3, 11], [5000]]),
    ]

    def request_state(self, request: AddedRequest) -> BadWords | None:
        words = [
            (list(word[:-1]), word[-1])
            for word in request.params.bad_words_token_ids or ()
            if 0 <= word[-1] < self.vocab_size
        ]
        if not words:
            return None
        return BadWords(words, request.token_ids, request.num_prompt_tokens)

    def edit_rows(self, logits: torch.Tensor) -> torch.Tensor:
        pairs = [
            (row, token)
            for row, state in self.active
            for token in state.banned_now(self.drafts_before_row(row))
        ]
        if not pairs:
            return logits
        return set_to_minus_inf(logits, pairs)
