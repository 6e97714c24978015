"""The ``xgrammar`` structured-output backend (the default).

JSON schemas compile to compact JSON (one space after ``:`` and ``,``, none elsewhere, so a
small model cannot wander into endless whitespace; ``strict_mode``: no properties the schema
does not list). xgrammar's rule for a string with ``minLength``/``maxLength`` lets raw
control characters through (invalid JSON); such strings are given the equivalent
``pattern`` without them (:func:`strict_bounded_strings`), which xgrammar honours;
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


def strict_bounded_strings(schema: Any) -> Any:
    """``schema`` with every length-bounded string (without a ``pattern`` or ``format``)
    given the pattern of as many JSON-safe characters: no control characters, quotes or
    backslashes (xgrammar's bounded strings allow no escapes either)."""
    if isinstance(schema, list):
        return [strict_bounded_strings(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    schema = {key: strict_bounded_strings(value) for key, value in schema.items()}
    bounded = "minLength" in schema or "maxLength" in schema
    if schema.get("type") == "string" and bounded and not {"pattern", "format"} & set(schema):
        low, high = schema.pop("minLength", 0), schema.pop("maxLength", "")
        schema["pattern"] = f'^[^\\x00-\\x1f"\\\\]{{{low},{high}}}$'
    return schema


def choice_ebnf(choices: list[str]) -> str:
    """An EBNF grammar accepting exactly one of ``choices``."""
    return "root ::= " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in choices)


def _grammar(xgr: Any, params: StructuredOutputsParams) -> Any:
    """The tokenizer-free grammar of ``params`` (what :meth:`validate` builds)."""
    kind = params.kind
    if kind in ("json", "json_object"):
        schema = {"type": "object"}
        if kind == "json":
            schema = strict_bounded_strings(json.loads(params.spec))
        return xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)
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
