"""Deliberately broken structured-output backends, each wrapping the xgrammar backend with
one bug, for ``test_suite_catches_bugs.py``."""

from __future__ import annotations

import vlite
from vlite.plugins.structured_outputs.xgrammar_backend import XGrammarBackend

#: A token of the tiny tokenizer that no test language uses ("z").
EXTRA_TOKEN_TEXT = "z"


class _Matcher:
    def __init__(self, inner) -> None:
        self.inner = inner

    def accept_token(self, token_id):
        return self.inner.accept_token(token_id)

    def fill_bitmask(self, bitmask, row):
        self.inner.fill_bitmask(bitmask, row)

    def rollback(self, num_tokens):
        self.inner.rollback(num_tokens)

    def is_terminated(self):
        return self.inner.is_terminated()


def _backend(matcher_cls, **overrides):
    """An XGrammarBackend whose matchers are ``matcher_cls`` around xgrammar's."""

    class Compiled:
        def __init__(self, inner) -> None:
            self.inner = inner

        def new_matcher(self):
            return matcher_cls(self.inner.new_matcher())

    class Backend(XGrammarBackend):
        def __init__(self, tokenizer, vocab_size) -> None:
            super().__init__(tokenizer, vocab_size)
            self.extra_token = tokenizer.convert_tokens_to_ids(EXTRA_TOKEN_TEXT)

        def compile(self, params):
            compiled = Compiled(super().compile(params))
            compiled.extra_token = self.extra_token
            return compiled

    for name, value in overrides.items():
        setattr(Backend, name, value)
    return Backend


class ExtraTokenMatcher(_Matcher):
    """Allows one token too many (token 100) while the output is unfinished."""

    def fill_bitmask(self, bitmask, row):
        super().fill_bitmask(bitmask, row)
        if not self.is_terminated():
            bitmask[row, 100 // 32] |= 1 << (100 % 32)

    def accept_token(self, token_id):
        return token_id == 100 or super().accept_token(token_id)


class NoRollbackMatcher(_Matcher):
    def rollback(self, num_tokens):
        pass


class RowZeroMatcher(_Matcher):
    """Fills its mask into row 0, whatever row it is given."""

    def fill_bitmask(self, bitmask, row):
        super().fill_bitmask(bitmask, 0)


class LenientMatcher(_Matcher):
    """Says yes to a forbidden token (without moving)."""

    def accept_token(self, token_id):
        self.inner.accept_token(token_id)
        return True


class NeverEndsMatcher(_Matcher):
    def is_terminated(self):
        return False


@classmethod
def _validate_nothing(cls, params):
    pass


BROKEN = {
    "extra-token": _backend(ExtraTokenMatcher),
    "no-rollback": _backend(NoRollbackMatcher),
    "row-zero": _backend(RowZeroMatcher),
    "lenient": _backend(LenientMatcher),
    "never-ends": _backend(NeverEndsMatcher),
    "validates-nothing": _backend(_Matcher, validate=_validate_nothing),
}


@vlite.hookimpl
def register_structured_output_backends(register):
    for name, cls in BROKEN.items():
        register(name, cls)
