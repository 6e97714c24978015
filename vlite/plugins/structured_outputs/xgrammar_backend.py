"""The ``xgrammar`` structured-output backend (the default).

JSON schemas compile to compact JSON (no whitespace between tokens, so a small model cannot
wander into endless whitespace; ``strict_mode``: no properties the schema does not list);
``json_object`` is the schema ``{"type": "object"}``; ``choice`` becomes a grammar of the
alternatives; ``grammar`` is xgrammar's EBNF (GBNF: ``root ::= ...``). xgrammar's compiler
caches its own work too, and releases the GIL while compiling.
"""

from __future__ import annotations

import json
from typing import Any

import torch

import vlite
from vlite.core.structured_output_params import StructuredOutputsParams
from vlite.plugins.structured_outputs.common import compile_error

NAME = "xgrammar"
#: Compiler threads per backend (the engine's pool adds its own parallelism).
COMPILER_THREADS = 2


def choice_ebnf(choices: list[str]) -> str:
    """An EBNF grammar accepting exactly one of ``choices``."""
    return "root ::= " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in choices)


def _grammar(xgr: Any, params: StructuredOutputsParams) -> Any:
    """The tokenizer-free grammar of ``params`` (what :meth:`validate` builds)."""
    kind = params.kind
    if kind in ("json", "json_object"):
        schema = params.spec if kind == "json" else '{"type": "object"}'
        return xgr.Grammar.from_json_schema(schema, any_whitespace=False)
    if kind == "regex":
        return xgr.Grammar.from_regex(params.regex)
    if kind == "choice":
        return xgr.Grammar.from_ebnf(choice_ebnf(params.choice))
    return xgr.Grammar.from_ebnf(params.grammar)


class XGrammarMatcher:
    """One request's position in an xgrammar grammar."""

    def __init__(self, compiled: Any) -> None:
        import xgrammar as xgr

        self._matcher = xgr.GrammarMatcher(compiled)

    def accept_token(self, token_id: int) -> bool:
        if self._matcher.is_terminated():
            return False
        return bool(self._matcher.accept_token(token_id))

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        if self._matcher.is_terminated():
            bitmask[row] = 0
            return
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self._matcher.rollback(num_tokens)

    def is_terminated(self) -> bool:
        return bool(self._matcher.is_terminated())


class XGrammarCompiled:
    """A compiled xgrammar grammar (shared, read-only)."""

    def __init__(self, compiled: Any) -> None:
        self._compiled = compiled

    def new_matcher(self) -> XGrammarMatcher:
        return XGrammarMatcher(self._compiled)


class XGrammarBackend:
    """Compiles constraints with xgrammar for one tokenizer.

    Args:
        tokenizer: the model's Hugging Face tokenizer.
        vocab_size: the width of the model's logits.
    """

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        import xgrammar as xgr

        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self._compiler = xgr.GrammarCompiler(info, max_threads=COMPILER_THREADS)

    @classmethod
    def validate(cls, params: StructuredOutputsParams) -> None:
        import xgrammar as xgr

        try:
            _grammar(xgr, params)
        except RuntimeError as exc:
            raise compile_error(params.kind, NAME, exc) from None

    def compile(self, params: StructuredOutputsParams) -> XGrammarCompiled:
        import xgrammar as xgr

        try:
            return XGrammarCompiled(self._compiler.compile_grammar(_grammar(xgr, params)))
        except RuntimeError as exc:
            raise compile_error(params.kind, NAME, exc) from None


@vlite.hookimpl
def register_structured_output_backends(register) -> None:
    register(NAME, XGrammarBackend)
