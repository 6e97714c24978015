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
            position: PositionLogprobs = {}
            for token_id, logprob, rank in zip(entry.token_ids, entry.logprobs, entry.ranks):
                if token_id not in position:
                    position[token_id] = Logprob(logprob, rank, self.token_texts(token_id))
            self.logprobs.append(position)
            self.cumulative_logprob += entry.logprobs[0]
