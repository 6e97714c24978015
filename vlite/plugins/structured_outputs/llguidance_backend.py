"""The ``llguidance`` structured-output backend.

llguidance builds the token mask lazily from a lexer and an Earley parser, so it needs no
ahead-of-time compilation of large grammars. JSON schemas compile to compact JSON
(``whitespace_flexible`` off), as with ``xgrammar``; ``grammar`` accepts Lark or GBNF
(llguidance tells them apart); ``choice`` is llguidance's own choice format.
"""

from __future__ import annotations

import json
from typing import Any

import torch

import vlite
from vlite.core.structured_output_params import StructuredOutputsParams
from vlite.plugins.structured_outputs.common import compile_error

NAME = "llguidance"
#: Compact JSON, as the xgrammar backend produces.
_JSON_OPTIONS = {"whitespace_flexible": False}


def _grammar_text(params: StructuredOutputsParams) -> str:
    """``params`` as an llguidance grammar definition (tokenizer-free)."""
    import llguidance

    kind = params.kind
    if kind in ("json", "json_object"):
        schema = json.loads(params.spec) if kind == "json" else {"type": "object"}
        schema = {**schema, "x-guidance": _JSON_OPTIONS} if isinstance(schema, dict) else schema
        return llguidance.grammar_from("json_schema", json.dumps(schema))
    if kind == "regex":
        return llguidance.grammar_from("regex", params.regex)
    if kind == "choice":
        return llguidance.grammar_from("choice", json.dumps(params.choice))
    return llguidance.grammar_from("grammar", params.grammar)


def _check(grammar: str) -> None:
    """Raise ``ValueError`` if llguidance rejects ``grammar``."""
    import llguidance

    problem = llguidance.LLMatcher.validate_grammar(grammar, None)
    if problem:
        raise ValueError(problem)


class LLGuidanceMatcher:
    """One request's position in an llguidance grammar."""

    def __init__(self, tokenizer: Any, grammar: str) -> None:
        import llguidance

        self._matcher = llguidance.LLMatcher(tokenizer, grammar)

    def accept_token(self, token_id: int) -> bool:
        if self._matcher.is_stopped() or self._matcher.is_error():
            return False
        if not self._matcher.validate_tokens([token_id]):
            return False
        return bool(self._matcher.consume_token(token_id))

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        import llguidance.torch

        if self._matcher.is_stopped():
            bitmask[row] = 0
            return
        llguidance.torch.fill_next_token_bitmask(self._matcher, bitmask, row)

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self._matcher.rollback(num_tokens)

    def is_terminated(self) -> bool:
        return bool(self._matcher.is_stopped())


class LLGuidanceCompiled:
    """A checked llguidance grammar for one tokenizer (matchers are built from its text)."""

    def __init__(self, tokenizer: Any, grammar: str) -> None:
        self._tokenizer = tokenizer
        self._grammar = grammar

    def new_matcher(self) -> LLGuidanceMatcher:
        return LLGuidanceMatcher(self._tokenizer, self._grammar)


class LLGuidanceBackend:
    """Compiles constraints with llguidance for one tokenizer.

    Args:
        tokenizer: the model's Hugging Face tokenizer.
        vocab_size: the width of the model's logits.
    """

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        import llguidance.hf

        self._tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)

    @classmethod
    def validate(cls, params: StructuredOutputsParams) -> None:
        try:
            _check(_grammar_text(params))
        except (ValueError, RuntimeError) as exc:
            raise compile_error(params.kind, NAME, exc) from None

    def compile(self, params: StructuredOutputsParams) -> LLGuidanceCompiled:
        try:
            grammar = _grammar_text(params)
            _check(grammar)
        except (ValueError, RuntimeError) as exc:
            raise compile_error(params.kind, NAME, exc) from None
        return LLGuidanceCompiled(self._tokenizer, grammar)


@vlite.hookimpl
def register_structured_output_backends(register) -> None:
    register(NAME, LLGuidanceBackend)
