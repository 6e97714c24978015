"""The structured-output backend interface (``register_structured_output_backends``) and
the token bitmask it fills.

A backend turns a request's :class:`~vlite.core.structured_output_params.StructuredOutputsParams`
into a grammar over the model's tokens. Three objects, three lifetimes:

- :class:`StructuredOutputBackend`: one per engine core and backend name, built on first
  use as ``cls(tokenizer, vocab_size)`` (the Hugging Face tokenizer; ``vocab_size`` is the
  width of the model's logits, which may exceed the tokenizer's). ``validate(params)`` is a
  class method that needs no tokenizer: the front end calls it to answer a bad schema with
  a 400 before the request reaches the engine.
- :class:`CompiledGrammar`: what ``compile(params)`` returns, on a worker thread, once per
  distinct constraint (the engine caches it by ``(backend, kind, spec)``; the tokenizer is
  the engine's own). It must be safe to share between requests.
- :class:`GrammarMatcher`: one per request (``compiled.new_matcher()``), the state of one
  output: which tokens may come next (:meth:`~GrammarMatcher.fill_bitmask`), the token that
  came (:meth:`~GrammarMatcher.accept_token`), undo (:meth:`~GrammarMatcher.rollback`), and
  whether the output is complete (:meth:`~GrammarMatcher.is_terminated`).

The bitmask is vlite's (and xgrammar's and llguidance's) layout: ``int32 [rows, words]``,
``words = ceil(vocab_size / 32)``, bit ``b`` of word ``w`` set when token ``32 * w + b`` is
allowed. The engine core fills one row per structured request that samples in a step and
ships it with the :class:`~vlite.core.outputs.SchedulerOutput`; the worker sets the logits
of the disallowed tokens to ``-inf`` before the sampler plugin runs.
"""

from __future__ import annotations

import sys
from typing import Any, Protocol

import torch

from vlite.core.structured_output_params import (
    CONSTRAINT_FIELDS,
    StructuredOutputsError,
    StructuredOutputsParams,
)

#: Tokens per bitmask word.
BITS_PER_WORD = 32


def bitmask_words(vocab_size: int) -> int:
    """How many int32 words hold one row of ``vocab_size`` bits."""
    return -(-vocab_size // BITS_PER_WORD)


def allocate_bitmask(num_rows: int, vocab_size: int) -> torch.Tensor:
    """``int32 [num_rows, words]`` with every token allowed (all bits set)."""
    return torch.full((num_rows, bitmask_words(vocab_size)), -1, dtype=torch.int32)


def allowed_tokens(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``bool [..., vocab_size]``: which tokens bitmask rows (``int32 [..., words]``) allow.

    Unpacked byte by byte (a little-endian int32 holds tokens ``32w .. 32w + 31`` in its
    bytes' order), a quarter of the work of shifting the words.
    """
    if sys.byteorder != "little":
        shifts = torch.arange(BITS_PER_WORD, dtype=torch.int32, device=bitmask.device)
        bits = (bitmask.unsqueeze(-1) >> shifts) & 1
        return bits.reshape(*bitmask.shape[:-1], -1)[..., :vocab_size].bool()
    shifts = torch.arange(8, dtype=torch.uint8, device=bitmask.device)
    bits = (bitmask.contiguous().view(torch.uint8).unsqueeze(-1) >> shifts) & 1
    return bits.reshape(*bitmask.shape[:-1], -1)[..., :vocab_size].bool()


class GrammarMatcher(Protocol):
    """One request's position in its grammar."""

    def accept_token(self, token_id: int) -> bool:
        """Advance by ``token_id``; ``False`` (and no change) if the grammar forbids it."""
        ...

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write row ``row`` of ``bitmask`` (``int32 [rows, words]``, CPU): the tokens that
        may come next (once terminated: none but the stop tokens, or none)."""
        ...

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens."""
        ...

    def is_terminated(self) -> bool:
        """Whether the output is complete (the grammar accepted its end)."""
        ...


class CompiledGrammar(Protocol):
    """A constraint compiled for the engine's tokenizer; shared by the requests using it."""

    def new_matcher(self) -> GrammarMatcher: ...


class StructuredOutputBackend(Protocol):
    """Compiles constraints into grammars over the model's tokens.

    Optional class attribute ``supported_kinds``: the constraint kinds it handles (a subset
    of :data:`~vlite.core.structured_output_params.CONSTRAINT_FIELDS`; default all). A
    request of another kind is refused naming the backend.
    """

    def __init__(self, tokenizer: Any, vocab_size: int) -> None: ...

    @classmethod
    def validate(cls, params: StructuredOutputsParams) -> None:
        """Raise ``ValueError`` naming the problem if ``params`` cannot compile (no
        tokenizer needed; called by the front end before the request is sent)."""
        ...

    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        """Compile ``params``; raise ``ValueError`` naming the problem if it cannot."""
        ...


def supported_kinds(backend_cls: type) -> tuple[str, ...]:
    """The constraint kinds ``backend_cls`` claims (absent attribute: all of them)."""
    return tuple(getattr(backend_cls, "supported_kinds", CONSTRAINT_FIELDS))


def check_backend_takes(name: str, backend_cls: type, params: StructuredOutputsParams) -> None:
    """Raise :class:`StructuredOutputsError` if backend ``name`` does not handle ``params``'s
    kind of constraint (its ``supported_kinds``)."""
    kinds = supported_kinds(backend_cls)
    if params.kind not in kinds:
        raise StructuredOutputsError(
            f"structured-output backend {name!r} does not support {params.kind!r} constraints "
            f"(it supports {', '.join(kinds)})",
            f"structured_outputs.{params.kind}",
        )
