"""Registers vlite's built-in logits processors (a ``vlite.builtin`` entry point).

In vLLM's order: ``allowed_token_ids``, ``bad_words``, ``logit_bias``, ``min_tokens``
(their edits commute: a bias added to ``-inf`` leaves it ``-inf``).
"""

from __future__ import annotations

from vlite.core.hookspecs import hookimpl
from vlite.plugins.logits_processors.allowed_token_ids import AllowedTokenIdsLogitsProcessor
from vlite.plugins.logits_processors.bad_words import BadWordsLogitsProcessor
from vlite.plugins.logits_processors.logit_bias import LogitBiasLogitsProcessor
from vlite.plugins.logits_processors.min_tokens import MinTokensLogitsProcessor


@hookimpl
def register_logits_processors(register):
    register("allowed_token_ids", AllowedTokenIdsLogitsProcessor)
    register("bad_words", BadWordsLogitsProcessor)
    register("logit_bias", LogitBiasLogitsProcessor)
    register("min_tokens", MinTokensLogitsProcessor)
