"""Incremental detokenization and stop-string matching for one request."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

# Tokens decoded before the first new one, so a word-piece gets its leading space right.
_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


def skip_special_decoder(tokenizer: Any) -> Callable[[list[int]], str]:
    """``tokenizer.decode(ids, skip_special_tokens=True)``, as fast as it can be had.

    A Hugging Face fast tokenizer's ``decode`` first converts its argument element by
    element (``to_py_obj``), which costs ~30 us for a few ids: at a batch of 256 decoding
    two windows per token, that was ~20 ms of every engine step on a GPU. When the Rust
    tokenizer's own ``decode`` gives the same text (no clean-up of tokenization spaces to
    apply afterwards), it is called directly; otherwise the full ``decode``.
    """
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return lambda token_ids: tokenizer.decode(token_ids, skip_special_tokens=True)
    return lambda token_ids: backend.decode(token_ids, skip_special_tokens=True)


class IncrementalDetokenizer:
    """Appends text as tokens arrive, never re-decoding the whole sequence.

    Each step decodes only a short window: ``prefix_offset:`` versus ``prefix_offset:
    read_offset``; the difference is the new text. Text that ends in an incomplete UTF-8
    sequence (a replacement character) is held back until the next token completes it.

    Args:
        tokenizer: a Hugging Face tokenizer.
        prompt_token_ids: the prompt; its last tokens give the first window its context.
        stop: stop strings; generation ends at the first one, which is cut from the text.
        min_tokens: stop strings are not looked for in the text of the first
            ``min_tokens`` tokens (vLLM's rule); a stop string that ends later may still
            begin in it.
    """

    def __init__(
        self, tokenizer: Any, prompt_token_ids: list[int], stop: list[str], min_tokens: int = 0
    ) -> None:
        self.tokenizer = tokenizer
        self._decode = skip_special_decoder(tokenizer)
        self.stop = stop
        self.min_tokens = min_tokens
        self.num_output_tokens = 0
        self.max_stop_len = max((len(s) for s in stop), default=0)
        self.token_ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)
        self.text = ""
        self.stop_string: str | None = None

    def add_tokens(self, new_token_ids: list[int]) -> bool:
        """Decode new tokens into :attr:`text`; return True when a stop string appeared."""
        for token_id in new_token_ids:
            self.token_ids.append(token_id)
            self.num_output_tokens += 1
            num_chars_before = len(self.text)
            self.text += self._decode_next()
            if self.num_output_tokens <= self.min_tokens:
                continue
            if self.stop and self._cut_at_stop_string(num_chars_before):
                return True
        return False

    @property
    def num_stable_chars(self) -> int:
        """Leading characters of :attr:`text` that no later token can cut at a stop string.

        A stop string found later must contain at least one new character, so only the
        last ``max_stop_len - 1`` characters are still in doubt.
        """
        if not self.stop:
            return len(self.text)
        return max(0, len(self.text) - self.max_stop_len + 1)

    def _decode_next(self) -> str:
        prefix = self._decode(self.token_ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.token_ids[self.prefix_offset :])
        if full.endswith(_REPLACEMENT_CHAR) or len(full) <= len(prefix):
            return ""
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.token_ids)
        return full[len(prefix) :]

    def _cut_at_stop_string(self, num_chars_before: int) -> bool:
        # A stop string may straddle the new text and the old, but must end in the new
        # (the old was searched already, or was protected by min_tokens).
        found = [
            (index, stop)
            for stop in self.stop
            if (index := self.text.find(stop, max(0, num_chars_before - len(stop) + 1))) != -1
        ]
        if not found:
            return False
        index, self.stop_string = min(found)
        self.text = self.text[:index]
        return True
