"""The grammar after the reasoning: the markers' automaton lets through exactly the replies
whose answer (as ``ReasoningMarkers.split`` defines it) is what the grammar was given, its
masks agree with what it accepts, and rollback undoes across the answer's start."""

from __future__ import annotations

import random

import pytest
import torch

from vlite.core.reasoning_grammar import (
    ANSWER,
    FIRST,
    REFUSED,
    AfterReasoningMatcher,
    marker_tables,
)
from vlite.core.reasoning_parser import ReasoningMarkers
from vlite.core.structured_output import allocate_bitmask, allowed_tokens

#: A vocabulary of marker pieces, whitespace, answer text and tokens that straddle them.
VOCAB = [
    None,  # a special token (end of sequence)
    "<", "think", ">", "<think>", "</think>", "</", "/", "th", "ink>", "k>", "<th", "</thi",
    "nk", " ", "\n", "  <", "a", "b c", "{", "}", "x</think>", "</think>\n", "<think>hi",
    ">a", "hi</think>", "</think>{", "<t", "\u00e9t\u00e9", "<<", "</think></think>",
    "t", "h", "i", "n", "k",  # every character, as real vocabularies have
]  # fmt: skip
EOS = 0
#: The fake grammar's answer: tokens made of these characters, ending at ``}``.
ANSWER_CHARACTERS = set("{}ab c\n")
QWEN3 = ReasoningMarkers("<think>", "</think>")
DEEPSEEK = ReasoningMarkers("<think>", "</think>", starts_in_reasoning=True)


class AnswerGrammar:
    """A grammar matcher of answers made of :data:`ANSWER_CHARACTERS`, done at ``}``."""

    def __init__(self) -> None:
        self.accepted: list[int] = []

    def _allows(self, token_id: int) -> bool:
        text = VOCAB[token_id]
        return not self.is_terminated() and text is not None and set(text) <= ANSWER_CHARACTERS

    def accept_token(self, token_id: int) -> bool:
        if not self._allows(token_id):
            return False
        self.accepted.append(token_id)
        return True

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask[row] = 0
        for token_id in range(len(VOCAB)):
            if self._allows(token_id):
                bitmask[row, token_id // 32] |= 1 << (token_id % 32)

    def rollback(self, num_tokens: int) -> None:
        del self.accepted[len(self.accepted) - num_tokens :]

    def is_terminated(self) -> bool:
        return bool(self.accepted) and VOCAB[self.accepted[-1]].endswith("}")


def matcher(markers: ReasoningMarkers) -> AfterReasoningMatcher:
    return AfterReasoningMatcher(AnswerGrammar(), marker_tables(markers, VOCAB, len(VOCAB)))


def allowed(m: AfterReasoningMatcher) -> list[int]:
    bitmask = allocate_bitmask(1, len(VOCAB))
    m.fill_bitmask(bitmask, 0)
    return allowed_tokens(bitmask, len(VOCAB))[0].nonzero().flatten().tolist()


def accepts(m: AfterReasoningMatcher, token_id: int) -> bool:
    """Whether ``m`` takes ``token_id`` (left as it was)."""
    if not m.accept_token(token_id):
        return False
    m.rollback(1)
    return True


def text_of(tokens: list[int]) -> str:
    return "".join(VOCAB[token] for token in tokens)


@pytest.mark.parametrize("markers", [QWEN3, DEEPSEEK], ids=["qwen3", "deepseek_r1"])
def test_random_replies_answer_exactly_what_the_grammar_was_given(markers):
    """Walks of allowed tokens: at every step the mask is what ``accept_token`` takes; a
    reply that reached its answer splits (by the markers' definition) into the reasoning
    and exactly the tokens the grammar accepted."""
    rng = random.Random(0)
    answered = 0
    for _ in range(300):
        m, tokens = matcher(markers), []
        while not m.is_terminated() and len(tokens) < 12:
            mask = allowed(m)
            assert mask == [t for t in range(len(VOCAB)) if accepts(m, t)], (
                f"after {text_of(tokens)!r}: the mask and accept_token disagree"
            )
            assert mask, f"after {text_of(tokens)!r} nothing may come"
            token = rng.choice(mask)
            assert m.accept_token(token)
            tokens.append(token)
        if m.state == ANSWER:
            answered += 1
            split = markers.split(text_of(tokens))
            assert split.answer == text_of(m.grammar.accepted), text_of(tokens)
            assert text_of(tokens).endswith(split.answer)
    assert answered > 50


def test_qwen3_may_answer_at_once_or_reason_first():
    m = matcher(QWEN3)
    assert m.state == FIRST
    first = {VOCAB[t] for t in allowed(m)}
    assert {"{", "a", "<think>", "<", " ", "<think>hi", "<th"} <= first
    assert not {">", "x</think>", "think", "</think>"} & first  # neither an answer nor <think>
    assert m.accept_token(VOCAB.index("{")) and m.state == ANSWER


def test_deepseek_reasons_from_the_first_token_and_the_answer_waits_for_the_end_marker():
    m = matcher(DEEPSEEK)
    for piece in ("a", "{", "<", "/", "think"):
        assert m.accept_token(VOCAB.index(piece))
        assert m.grammar.accepted == []  # all of it is reasoning
    assert not accepts(m, VOCAB.index(">a"))  # the end marker and answer text in one token
    assert m.accept_token(VOCAB.index(">"))
    assert m.state == ANSWER and m.grammar.accepted == []
    assert m.accept_token(VOCAB.index("{")) and m.grammar.accepted == [VOCAB.index("{")]


def test_the_reasoning_never_ends_the_reply():
    m = matcher(DEEPSEEK)
    assert EOS not in allowed(m) and not m.accept_token(EOS)
    tables = m.tables
    assert (tables.next_state[:, EOS] == REFUSED).all()


def test_rollback_undoes_the_answer_and_the_markers():
    m = matcher(QWEN3)
    reply = ["<think>", "hi</think>", "{", "a"]
    for piece in reply:
        assert m.accept_token(VOCAB.index(piece))
    m.rollback(3)  # back into the reasoning, the grammar's two tokens undone
    assert m.grammar.accepted == [] and m.state == len("<think>")
    assert m.accept_token(VOCAB.index("</think>")) and m.state == ANSWER
    m.rollback(2)
    assert m.state == FIRST


def test_tokens_past_the_tables_are_refused():
    m = matcher(DEEPSEEK)
    assert not m.accept_token(len(VOCAB)) and not m.accept_token(-1)


def test_markers_are_checked():
    with pytest.raises(ValueError, match="must not occur"):
        ReasoningMarkers("<think></think>", "</think>")
    with pytest.raises(ValueError, match="non-empty"):
        ReasoningMarkers("", "</think>")


def test_markers_that_are_not_ascii_are_refused_by_the_automaton():
    with pytest.raises(ValueError, match="ASCII markers"):
        marker_tables(ReasoningMarkers("\u25c1think\u25b7", "\u25c1/think\u25b7"), VOCAB, 40)
