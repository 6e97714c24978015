"""The grammar of an answer that follows a reasoning block.

A request whose ``structured_outputs`` sets ``after_reasoning`` (the
:class:`~vlite.core.reasoning_parser.ReasoningMarkers` of a reasoning parser) is
constrained in its answer only: the reasoning runs free, and the request's grammar starts
at the token after the end marker. :class:`AfterReasoningMatcher` wraps the grammar's
matcher, so every structured-output backend gets this, with a small automaton over the
two markers whose token masks are computed once per tokenizer and markers
(:func:`marker_tables`).

What the automaton lets come, token by token (the markers' rules, as the parser splits):

- first (unless ``starts_in_reasoning``): a token that begins the answer (its text,
  leading whitespace stripped, neither a prefix of ``start`` nor beginning with it) where
  the grammar allows it, or one that begins the start marker (whitespace, part of the
  marker, or all of it and reasoning after);
- while the start marker is being written: the rest of it (with ``starts_in_reasoning``,
  any text, which is then reasoning);
- in the reasoning: text in which ``end`` does not appear, or appears ending exactly at
  the token's end; special tokens (end of sequence among them) are refused, so the
  reasoning ends and the answer comes;
- after ``end``: the grammar, from its start.

So an answer starts on a token boundary (a token holding the end marker and the answer's
first characters is refused: the model writes them as two tokens), and a reply that opens
with whitespace goes on to reason (the grammar's answer cannot start in whitespace the
automaton already let through).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from vlite.core.reasoning_parser import ReasoningMarkers
from vlite.core.structured_output import BITS_PER_WORD, CompiledGrammar, GrammarMatcher

#: ``next_state`` of a token that may not come in that state.
REFUSED = -1
#: ``next_state`` of a token that ends the reasoning: the grammar takes over.
ANSWER = -2
#: The matcher's state at the first token of a reply that may answer at once.
FIRST = -3


@dataclass(frozen=True)
class MarkerTables:
    """The automaton of one tokenizer and :class:`ReasoningMarkers`.

    States ``0 .. len(start) - 1``: that many characters of the start marker written (after
    whitespace); ``len(start) + s``: in the reasoning, its text ending in the end marker's
    first ``s`` characters.

    Attributes:
        markers: the markers.
        next_state: ``int16 [num_states, vocab_size]``: the state after each token,
            :data:`REFUSED` or :data:`ANSWER`.
        masks: ``int32 [num_states, words]``: the bitmask row of each state (the tokens
            whose ``next_state`` is not :data:`REFUSED`).
        answers_first: ``bool [vocab_size]``: the tokens that begin an answer as a reply's
            first token.
        answers_first_mask: ``int32 [words]``: ``answers_first`` as a bitmask row.
    """

    markers: ReasoningMarkers
    next_state: np.ndarray
    masks: np.ndarray
    answers_first: np.ndarray
    answers_first_mask: np.ndarray

    @property
    def vocab_size(self) -> int:
        return self.next_state.shape[1]

    @property
    def reasoning_state(self) -> int:
        """The state at the start of the reasoning (the start marker written)."""
        return len(self.markers.start)

    @property
    def initial_state(self) -> int:
        """A reply's state before its first token."""
        return 0 if self.markers.starts_in_reasoning else FIRST


def marker_tables(
    markers: ReasoningMarkers, token_texts: Sequence[str | None], vocab_size: int
) -> MarkerTables:
    """The automaton of ``markers`` over tokens whose texts are ``token_texts`` (``None``
    for a special token, which is refused in every marker state; ids from
    ``len(token_texts)`` to ``vocab_size`` are refused too).

    Tokens that differ only in characters the markers do not have behave alike, so each
    state is walked once per distinct shape of token (:class:`_Shapes`), not once per token.

    Raises:
        ValueError: a marker is not ASCII (a token's decoded text loses the bytes of a
            character split between tokens, which only ASCII markers cannot contain).
    """
    if not (markers.start.isascii() and markers.end.isascii()):
        raise ValueError(f"a constraint after the reasoning needs ASCII markers; {markers} are not")
    shape_of = _Shapes(markers)
    index_of: dict[str, int] = {}
    token_shape = np.full(vocab_size, -1, dtype=np.int64)
    for token_id, text in enumerate(token_texts[:vocab_size]):
        if text is not None and text != "":
            token_shape[token_id] = index_of.setdefault(shape_of(text), len(index_of))
    shapes = list(index_of)
    num_states = len(markers.start) + len(markers.end)
    known = token_shape >= 0
    next_state = np.full((num_states, vocab_size), REFUSED, dtype=np.int16)
    for state in range(num_states):
        outcome = np.array([_walk(markers, state, shape) for shape in shapes], dtype=np.int16)
        next_state[state, known] = outcome[token_shape[known]]
    answers = np.array([_answers_first(markers, shape) for shape in shapes], dtype=bool)
    answers_first = np.zeros(vocab_size, dtype=bool)
    answers_first[known] = answers[token_shape[known]]
    return MarkerTables(
        markers,
        next_state,
        np.stack([_bitmask_row(row != REFUSED) for row in next_state]),
        answers_first,
        _bitmask_row(answers_first),
    )


class _Shapes:
    """A token's text with every character the markers lack replaced by one stand-in
    (whitespace by a whitespace one), runs of stand-ins collapsed."""

    def __init__(self, markers: ReasoningMarkers) -> None:
        kept = set(markers.start) | set(markers.end)
        self.other = next(c for c in ("\x00", "\x01", "\x02") if c not in kept)
        self.space = next(c for c in (" ", "\t", "\u3000") if c not in kept)
        kept_class = "".join(re.escape(c) for c in sorted(kept))
        self._others = re.compile(rf"[^{kept_class}\s]+")
        spaces = "".join(re.escape(c) for c in sorted(c for c in kept if c.isspace()))
        self._spaces = re.compile(rf"[^\S{spaces}]+" if spaces else r"\s+")

    def __call__(self, text: str) -> str:
        return self._spaces.sub(self.space, self._others.sub(self.other, text))


def _walk(markers: ReasoningMarkers, state: int, text: str) -> int:
    """The state after ``text`` from ``state`` (or :data:`REFUSED`, :data:`ANSWER`)."""
    start = markers.start
    if state >= len(start):
        return _reason(markers, state - len(start), text)
    written = start[:state]
    so_far = written + (text.lstrip() if state == 0 else text)
    if start.startswith(so_far):
        return len(so_far)  # len(start): the marker is complete, the reasoning begins
    if so_far.startswith(start):
        return _reason(markers, 0, so_far[len(start) :])
    if not markers.starts_in_reasoning:
        return REFUSED
    return _reason(markers, 0, written + text)  # no start marker: all of it is reasoning


def _reason(markers: ReasoningMarkers, matched: int, text: str) -> int:
    """The state after reasoning ``text`` that follows ``matched`` characters of ``end``."""
    end = markers.end
    so_far = end[:matched] + text
    at = so_far.find(end)
    if at >= 0:
        return ANSWER if at + len(end) == len(so_far) else REFUSED
    for size in range(min(len(end) - 1, len(so_far)), 0, -1):
        if so_far.endswith(end[:size]):
            return len(markers.start) + size
    return len(markers.start)


def _answers_first(markers: ReasoningMarkers, text: str) -> bool:
    """Whether ``text``, as a reply's first token, begins an answer rather than the start
    marker (never with ``starts_in_reasoning``)."""
    stripped = text.lstrip()
    start = markers.start
    return (
        not markers.starts_in_reasoning
        and bool(stripped)
        and not (start.startswith(stripped) or stripped.startswith(start))
    )


def _bitmask_row(allowed: np.ndarray) -> np.ndarray:
    """``int32 [words]``: ``allowed`` (``bool [vocab_size]``) in the bitmask's layout."""
    words = -(-len(allowed) // BITS_PER_WORD)
    padded = np.zeros(words * BITS_PER_WORD, dtype=bool)
    padded[: len(allowed)] = allowed
    return np.packbits(padded, bitorder="little").view("<i4").astype(np.int32)


def token_texts(tokenizer: Any, vocab_size: int) -> list[str | None]:
    """Each token's text (``None`` for special tokens and ids the tokenizer lacks)."""
    special = set(tokenizer.all_special_ids)
    size = min(len(tokenizer), vocab_size)
    return [None if i in special else tokenizer.decode([i]) for i in range(size)]


class AfterReasoningMatcher:
    """A :class:`~vlite.core.structured_output.GrammarMatcher`: the markers' automaton,
    then ``grammar`` (a fresh matcher of the request's grammar) for the answer."""

    def __init__(self, grammar: GrammarMatcher, tables: MarkerTables) -> None:
        self.grammar = grammar
        self.tables = tables
        self.state = tables.initial_state
        #: Per accepted token: the state before it, and whether the grammar took it.
        self._history: list[tuple[int, bool]] = []

    def accept_token(self, token_id: int) -> bool:
        state, tables = self.state, self.tables
        if state == ANSWER or (state == FIRST and self._answers_first(token_id)):
            if not self.grammar.accept_token(token_id):
                return False
            self._history.append((state, True))
            self.state = ANSWER
            return True
        marker_state = 0 if state == FIRST else state
        if not 0 <= token_id < tables.vocab_size:
            return False
        after = int(tables.next_state[marker_state, token_id])
        if after == REFUSED:
            return False
        self._history.append((state, False))
        self.state = after
        return True

    def _answers_first(self, token_id: int) -> bool:
        return 0 <= token_id < self.tables.vocab_size and bool(self.tables.answers_first[token_id])

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        state, tables = self.state, self.tables
        if state == ANSWER:
            self.grammar.fill_bitmask(bitmask, row)
            return
        if state != FIRST:
            bitmask[row] = torch.from_numpy(tables.masks[state])
            return
        self.grammar.fill_bitmask(bitmask, row)
        bitmask[row] &= torch.from_numpy(tables.answers_first_mask)
        bitmask[row] |= torch.from_numpy(tables.masks[0])

    def rollback(self, num_tokens: int) -> None:
        if not num_tokens:
            return
        undone = self._history[-num_tokens:]
        del self._history[-num_tokens:]
        self.grammar.rollback(sum(took for _, took in undone))
        self.state = undone[0][0]

    def is_terminated(self) -> bool:
        return self.state == ANSWER and self.grammar.is_terminated()


@dataclass(frozen=True)
class AfterReasoningGrammar:
    """A :class:`~vlite.core.structured_output.CompiledGrammar` whose matchers let the
    reasoning run before ``grammar``."""

    grammar: CompiledGrammar
    tables: MarkerTables

    def new_matcher(self) -> AfterReasoningMatcher:
        return AfterReasoningMatcher(self.grammar.new_matcher(), self.tables)
