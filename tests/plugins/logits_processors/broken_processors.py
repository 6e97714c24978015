"""Deliberately broken logits processors: LogitsProcessorConformance must fail on each.

Each is a small change to a correct built-in, of the kind a plugin author could make by
mistake (several are what porting vLLM's slot-indexed processors naively gives).
``test_logits_processor_suite_catches_bugs.py`` runs the suite on them with pytester.
"""

from __future__ import annotations

import torch

from vlite.core.hookspecs import hookimpl
from vlite.core.logits_processor import BatchUpdate, LogitsProcessor
from vlite.plugins.logits_processors.allowed_token_ids import AllowedTokenIdsLogitsProcessor
from vlite.plugins.logits_processors.bad_words import BadWordsLogitsProcessor
from vlite.plugins.logits_processors.logit_bias import LogitBiasLogitsProcessor
from vlite.plugins.logits_processors.min_tokens import MinTokens, MinTokensLogitsProcessor


class EveryRowLogitBias(LogitBiasLogitsProcessor):
    """Adds each biased request's bias to every row of the batch."""

    def edit_rows(self, logits):
        for _, (token_ids, biases) in self.active:
            logits[:, token_ids] += torch.tensor(biases, dtype=logits.dtype)
        return logits


class RemovedKeepingLogitBias(LogitsProcessor):
    """Keeps every request it ever saw with a bias, even after it is removed (and when its
    id comes back for a request without a bias)."""

    active_params = LogitBiasLogitsProcessor.active_params

    def __init__(self, config, device, vocab_size):
        super().__init__(config, device, vocab_size)
        self.biases: dict[str, dict[int, float]] = {}
        self.rows: list[str] = []

    def update_state(self, batch_update: BatchUpdate) -> None:
        for request in batch_update.added:
            if request.params.logit_bias:
                self.biases[request.request_id] = request.params.logit_bias
        self.rows = batch_update.rows

    def apply(self, logits):
        if not self.biases:
            return logits
        for row, request_id in enumerate(self.rows):
            for token_id, bias in self.biases.get(request_id, {}).items():
                if token_id < self.vocab_size:
                    logits[row, token_id] += bias
        return logits


class RowRememberingLogitBias(LogitsProcessor):
    """Remembers the row each biased request had in the step it arrived (a slot index, as
    in vLLM's persistent batch) and edits that row ever after, though rows move."""

    active_params = LogitBiasLogitsProcessor.active_params

    def __init__(self, config, device, vocab_size):
        super().__init__(config, device, vocab_size)
        self.row_of: dict[str, int] = {}
        self.bias_of_row: dict[int, dict[int, float]] = {}

    def update_state(self, batch_update: BatchUpdate) -> None:
        for request_id in batch_update.removed:
            self.bias_of_row.pop(self.row_of.pop(request_id, -1), None)
        for request in batch_update.added:
            bias = request.params.logit_bias
            if bias and request.request_id in batch_update.rows:
                row = batch_update.rows.index(request.request_id)
                self.row_of[request.request_id] = row
                self.bias_of_row[row] = bias

    def apply(self, logits):
        for row, bias in self.bias_of_row.items():
            for token_id, value in bias.items():
                if row < logits.shape[0] and token_id < self.vocab_size:
                    logits[row, token_id] += value
        return logits


class StaleTokensMinTokens(MinTokensLogitsProcessor):
    """Copies the request's tokens when it is added: never sees its output grow."""

    def request_state(self, request):
        state = super().request_state(request)
        if state is None:
            return None
        return MinTokens(
            state.min_tokens, state.stop_ids, list(state.token_ids), state.num_prompt_tokens
        )


class AlwaysMaskingAllowedTokenIds(AllowedTokenIdsLogitsProcessor):
    """Builds an all-false mask and applies it on every step, used or not."""

    def apply(self, logits):
        if not self.active:
            nothing = torch.zeros_like(logits, dtype=torch.bool)
            return logits.masked_fill_(nothing, float("-inf"))
        return self.edit_rows(logits)


class Float64LogitBias(LogitBiasLogitsProcessor):
    """Adds a float64 bias table, so the logits come back float64."""

    def edit_rows(self, logits):
        table = torch.zeros(logits.shape, dtype=torch.float64)
        for row, (token_ids, biases) in self.active:
            table[row, token_ids] = torch.tensor(biases, dtype=torch.float64)
        return logits + table


class DraftBlindBadWords(BadWordsLogitsProcessor):
    """Claims ``follows_drafts`` but bans by the request's tokens alone: a row after drafts
    misses a word the drafts began."""

    def drafts_before_row(self, row: int) -> list[int]:
        return []


@hookimpl
def register_logits_processors(register):
    register("every-row-bias", EveryRowLogitBias)
    register("removed-keeping-bias", RemovedKeepingLogitBias)
    register("row-remembering-bias", RowRememberingLogitBias)
    register("stale-tokens-min-tokens", StaleTokensMinTokens)
    register("always-masking-allowed", AlwaysMaskingAllowedTokenIds)
    register("float64-bias", Float64LogitBias)
    register("draft-blind-bad-words", DraftBlindBadWords)
