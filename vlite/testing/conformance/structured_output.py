"""StructuredOutputBackendConformance: exact masks, acceptance and rollback, termination,
batch invariance, validation, and JSON that parses.

The backend is built on the tiny byte-level tokenizer of :mod:`vlite.testing.tiny_models`
(every byte is a token, so any text can be spelled), with a logits width larger than the
tokenizer's (a model's padded vocabulary): those extra ids must never be allowed.

Exactness is checked against an oracle on finite languages (the same strings written as
choices, a regex, a grammar and a JSON enum): at every step of seeded random walks through
the language, a token other than a stop token is allowed exactly when the text so far plus
the token's text is a prefix of a string of the language; a stop token is allowed only once
the text is a whole string (or the matcher has already terminated there).
"""

from __future__ import annotations

import json
import random
from typing import Any, ClassVar

import pytest
import torch

from vlite.core.structured_output import (
    allocate_bitmask,
    allowed_tokens,
    check_backend_takes,
    supported_kinds,
)
from vlite.core.structured_output_params import StructuredOutputsError, StructuredOutputsParams
from vlite.testing.conformance.base import PluginConformance

#: Extra logits beyond the tokenizer's tokens (a model's padded vocabulary).
VOCAB_PADDING = 13
#: A finite language, and the same language in each constraint kind.
WORDS = ["ab", "abc", "ba", "b+1"]
LANGUAGE_SPECS: dict[str, dict[str, Any]] = {
    "choice": {"choice": WORDS},
    "regex": {"regex": r"abc?|ba|b\+1"},
    "grammar": {"grammar": 'root ::= "ab" "c"? | "ba" | "b+1"'},
    "json": {"json": {"enum": WORDS}},  # the JSON texts "ab", "abc", ... (quoted)
}
#: A bounded JSON schema whose random outputs must parse and validate.
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 2},
    },
    "required": ["name", "age", "ok", "tags"],
    "additionalProperties": False,
}
#: Why JSON walks pick ASCII tokens: in a byte-level vocabulary a token may be one byte of
#: a multi-byte character, and xgrammar's character classes let such a byte through alone
#: (invalid UTF-8; llguidance does not). Models do not write such sequences in practice.
WALK_NOTE = "walks pick printable ASCII tokens where any is allowed"
INVALID_SPECS: dict[str, dict[str, Any]] = {
    "regex": {"regex": "a(b"},
    "grammar": {"grammar": "root ::= undefined_rule"},
    "json": {"json": {"type": "no-such-type"}},
}


class StructuredOutputBackendConformance(PluginConformance):
    """Subclass with ``plugin_name = "<your backend>"``.

    Attributes:
        num_walks: random walks per language (each checks every mask on its way).
        seed: the walks' seed.
    """

    plugin_kind: ClassVar[str] = "structured_output_backend"
    num_walks: ClassVar[int] = 6
    seed: ClassVar[int] = 1234

    # ---- fixtures --------------------------------------------------------------------

    @pytest.fixture(scope="class")
    @classmethod
    def tokenizer(cls) -> Any:
        from vlite.testing.tiny_models import make_tiny_tokenizer

        return make_tiny_tokenizer()

    @pytest.fixture(scope="class")
    @classmethod
    def vocab_size(cls, tokenizer) -> int:
        return len(tokenizer) + VOCAB_PADDING

    @pytest.fixture(scope="class")
    @classmethod
    def token_texts(cls, tokenizer) -> dict[int, str]:
        """The text of every ordinary token (special tokens left out)."""
        special = set(tokenizer.all_special_ids)
        return {
            token_id: tokenizer.decode([token_id])
            for token_id in range(len(tokenizer))
            if token_id not in special
        }

    @pytest.fixture(scope="class")
    @classmethod
    def backend(cls, plugin_cls, tokenizer, vocab_size) -> Any:
        return plugin_cls(tokenizer, vocab_size)

    def params(self, plugin_cls, kind: str, spec: dict[str, Any]) -> StructuredOutputsParams:
        if kind not in supported_kinds(plugin_cls):
            pytest.skip(f"the backend does not support {kind!r} constraints")
        return StructuredOutputsParams(**spec)

    # ---- helpers ---------------------------------------------------------------------

    @staticmethod
    def mask_of(matcher, vocab_size: int) -> set[int]:
        bitmask = allocate_bitmask(1, vocab_size)
        matcher.fill_bitmask(bitmask, 0)
        return set(allowed_tokens(bitmask[0], vocab_size).nonzero().flatten().tolist())

    @staticmethod
    def richest_constraint(plugin_cls) -> tuple[str, dict[str, Any]]:
        """The longest-running constraint the backend takes: the JSON schema ``PERSON``
        where it takes JSON, else the finite language in its first kind."""
        kinds = supported_kinds(plugin_cls)
        if "json" in kinds:
            return "json", {"json": PERSON}
        kind = next((k for k in LANGUAGE_SPECS if k in kinds), None)
        if kind is None:
            pytest.skip("the backend supports none of the suite's constraint kinds")
        return kind, LANGUAGE_SPECS[kind]

    @staticmethod
    def language(kind: str) -> list[str]:
        return [json.dumps(word) for word in WORDS] if kind == "json" else list(WORDS)

    # ---- tests -----------------------------------------------------------------------

    @pytest.mark.parametrize("kind", list(LANGUAGE_SPECS))
    def test_masks_are_exact_for_a_finite_language(
        self, plugin_cls, backend, tokenizer, token_texts, vocab_size, kind
    ):
        params = self.params(plugin_cls, kind, LANGUAGE_SPECS[kind])
        compiled = backend.compile(params)
        language = self.language(kind)
        stop_ids = {tokenizer.eos_token_id}
        rng = random.Random(self.seed)
        for walk in range(self.num_walks):
            matcher, text = compiled.new_matcher(), ""
            for _ in range(20):
                allowed = self.mask_of(matcher, vocab_size)
                if matcher.is_terminated():
                    assert text in language, f"walk {walk}: terminated after {text!r}"
                    assert allowed <= stop_ids, f"terminated after {text!r} yet allows {allowed}"
                    break
                expected = {
                    t for t, piece in token_texts.items()
                    if any(word.startswith(text + piece) for word in language)
                }  # fmt: skip
                ordinary = allowed - stop_ids
                assert ordinary == expected, (
                    f"{kind} walk {walk} after {text!r}: allowed but not a prefix "
                    f"{sorted(ordinary - expected)[:10]}, a prefix but not allowed "
                    f"{sorted(expected - ordinary)[:10]}"
                )
                assert max(allowed, default=0) < len(tokenizer), "a padding id is allowed"
                if text not in language:
                    assert not allowed & stop_ids, f"a stop token is allowed after {text!r}"
                choices = sorted(allowed)
                token = rng.choice(choices)
                assert matcher.accept_token(token), f"the mask allowed {token} but it was refused"
                if token not in stop_ids:
                    text += token_texts[token]
            assert matcher.is_terminated(), f"walk {walk} never terminated ({text!r})"
            assert text in language

    def test_a_forbidden_token_is_refused_and_changes_nothing(
        self, plugin_cls, backend, token_texts, vocab_size
    ):
        matcher = backend.compile(self.params(plugin_cls, "choice", LANGUAGE_SPECS["choice"]))
        matcher = matcher.new_matcher()
        before = self.mask_of(matcher, vocab_size)
        forbidden = next(t for t, piece in token_texts.items() if piece == "z")

        assert not matcher.accept_token(forbidden)
        assert self.mask_of(matcher, vocab_size) == before
        assert not matcher.is_terminated()

    def test_rollback_returns_to_the_earlier_masks(self, plugin_cls, backend, vocab_size):
        kind, spec = self.richest_constraint(plugin_cls)
        compiled = backend.compile(self.params(plugin_cls, kind, spec))
        matcher = compiled.new_matcher()
        rng = random.Random(self.seed)
        masks, tokens = [], []
        for _ in range(12):
            if matcher.is_terminated():
                break
            mask = self.mask_of(matcher, vocab_size)
            masks.append(mask)
            token = rng.choice(sorted(mask))
            assert matcher.accept_token(token)
            tokens.append(token)
        assert len(tokens) >= 2, f"a walk of {kind!r} ended after {tokens}"

        back = min(5, len(tokens) - 1)
        kept = len(tokens) - back
        matcher.rollback(back)
        assert self.mask_of(matcher, vocab_size) == masks[kept]
        for token, mask in zip(tokens[kept:], masks[kept:]):  # replaying gives the same masks
            assert self.mask_of(matcher, vocab_size) == mask
            assert matcher.accept_token(token)
        at_end = self.mask_of(matcher, vocab_size)
        matcher.rollback(0)  # undoes nothing
        assert self.mask_of(matcher, vocab_size) == at_end
        matcher.rollback(1)
        assert self.mask_of(matcher, vocab_size) == masks[-1]
        assert matcher.accept_token(tokens[-1])
        matcher.rollback(len(tokens))
        assert self.mask_of(matcher, vocab_size) == masks[0]

    def test_matchers_of_one_compiled_grammar_are_independent(
        self, plugin_cls, backend, token_texts, vocab_size
    ):
        compiled = backend.compile(self.params(plugin_cls, "choice", LANGUAGE_SPECS["choice"]))
        first, second = compiled.new_matcher(), compiled.new_matcher()
        fresh = self.mask_of(second, vocab_size)
        token_b = next(t for t, piece in token_texts.items() if piece == "b")

        assert first.accept_token(token_b)

        assert self.mask_of(second, vocab_size) == fresh
        assert self.mask_of(first, vocab_size) != fresh

    def test_rows_are_filled_alone_whatever_the_batch(
        self, plugin_cls, backend, token_texts, vocab_size
    ):
        simple = next((k for k in LANGUAGE_SPECS if k in supported_kinds(plugin_cls)), None)
        if simple is None:
            pytest.skip("the backend supports none of the suite's constraint kinds")
        constraints = [
            (simple, LANGUAGE_SPECS[simple]),
            self.richest_constraint(plugin_cls),
            (simple, LANGUAGE_SPECS[simple]),
        ]
        matchers = [
            backend.compile(self.params(plugin_cls, kind, spec)).new_matcher()
            for kind, spec in constraints
        ]
        token_b = next(t for t, piece in token_texts.items() if piece == "b")
        assert matchers[2].accept_token(token_b)
        alone = []
        for matcher in matchers:
            bitmask = allocate_bitmask(1, vocab_size)
            matcher.fill_bitmask(bitmask, 0)
            alone.append(bitmask[0].clone())

        for order in ([0, 1, 2], [2, 0, 1]):
            bitmask = allocate_bitmask(4, vocab_size)
            sentinel = torch.full_like(bitmask[3], 0x5A5A5A5A)
            bitmask[3] = sentinel
            for row, index in enumerate(order):
                matchers[index].fill_bitmask(bitmask, row)
            for row, index in enumerate(order):
                assert torch.equal(bitmask[row], alone[index]), f"row {row} differs in {order}"
            assert torch.equal(bitmask[3], sentinel), "a fill wrote outside its row"

    def test_json_outputs_parse_and_validate(
        self, plugin_cls, backend, tokenizer, token_texts, vocab_size
    ):
        jsonschema = pytest.importorskip("jsonschema")
        compiled = backend.compile(self.params(plugin_cls, "json", {"json": PERSON}))
        rng = random.Random(self.seed)
        for walk in range(self.num_walks):
            matcher, tokens = compiled.new_matcher(), []
            for _ in range(200):
                if matcher.is_terminated():
                    break
                allowed = sorted(self.mask_of(matcher, vocab_size))
                assert allowed, f"walk {walk}: nothing allowed after {tokens}"
                # Printable ASCII where any is allowed (a byte-level vocabulary's lone UTF-8
                # bytes are a character-level grammar's blind spot, see WALK_NOTE), and
                # ending a string or number soon, so that the walk finishes.
                ascii_ = [t for t in allowed if token_texts.get(t, "\x80").isascii()]
                allowed = ascii_ or allowed
                closers = [t for t in allowed if token_texts.get(t, "").strip() in '",}]']
                token = rng.choice(closers if closers and rng.random() < 0.4 else allowed)
                assert matcher.accept_token(token)
                tokens.append(token)
            text = tokenizer.decode(tokens, skip_special_tokens=True)
            assert matcher.is_terminated(), f"walk {walk} did not finish: {text!r}"
            jsonschema.validate(json.loads(text), PERSON)

    @pytest.mark.parametrize("kind", list(INVALID_SPECS))
    def test_validate_and_compile_refuse_what_cannot_compile(self, plugin_cls, backend, kind):
        params = self.params(plugin_cls, kind, INVALID_SPECS[kind])

        with pytest.raises(ValueError):
            plugin_cls.validate(params)
        with pytest.raises(ValueError):
            backend.compile(params)

    @pytest.mark.parametrize("kind", list(LANGUAGE_SPECS))
    def test_validate_accepts_what_compiles(self, plugin_cls, kind):
        plugin_cls.validate(self.params(plugin_cls, kind, LANGUAGE_SPECS[kind]))

    @pytest.mark.parametrize("kind", list(LANGUAGE_SPECS))
    def test_a_kind_the_backend_does_not_claim_is_refused_naming_it(self, plugin_cls, kind):
        if kind in supported_kinds(plugin_cls):
            pytest.skip(f"the backend supports {kind!r} constraints")
        params = StructuredOutputsParams(**LANGUAGE_SPECS[kind])

        with pytest.raises(StructuredOutputsError, match=f"does not support {kind!r}"):
            check_backend_takes(self.plugin_name, plugin_cls, params)
