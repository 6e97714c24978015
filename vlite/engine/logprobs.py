"""Front-end logprobs: the core's SampledLogprobs turned into vLLM's ``Logprob`` dicts."""

from __future__ import annotations

from typing import Any

from vlite.core.outputs import Logprob, PositionLogprobs, SampledLogprobs


class TokenTexts:
    """Each token's text on its own (``decode([token_id])``), cached across requests.

    The cache holds at most one entry per vocabulary token.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._texts: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self.tokenizer.decode([token_id])
        return text


class LogprobsAccumulator:
    """One request's logprobs so far: a dict per generated token, and their sum.

    Args:
        token_texts: decodes a single token (shared by every request).
    """

    def __init__(self, token_texts: TokenTexts) -> None:
        self.token_texts = token_texts
        self.logprobs: list[PositionLogprobs] = []
        self.cumulative_logprob = 0.0

    def add(self, entries: list[SampledLogprobs]) -> None:
        """Append one position per entry: the sampled token first, then the top ones."""
        for entry in entries:
            self.logprobs.append(position_logprobs(entry, self.token_texts))
            self.cumulative_logprob += entry.logprobs[0]


def position_logprobs(entry: SampledLogprobs, token_texts: TokenTexts) -> PositionLogprobs:
    """One position's dict: its token (sampled, or the prompt's) first, then the top ones."""
    position: PositionLogprobs = {}
    for token_id, logprob, rank in zip(entry.token_ids, entry.logprobs, entry.ranks):
        if token_id not in position:
            position[token_id] = Logprob(logprob, rank, token_texts(token_id))
    return position


def prompt_position_logprobs(
    entries: list[SampledLogprobs], token_texts: TokenTexts
) -> list[PositionLogprobs | None]:
    """``RequestOutput.prompt_logprobs``: ``None`` for the first prompt token (nothing comes
    before it), then one dict per entry."""
    return [None, *(position_logprobs(entry, token_texts) for entry in entries)]
