"""The ``suffix`` proposer: prompt lookup (``ngram``), and where the request's own tokens
have no match, what followed the same n-gram in the outputs of requests that finished.

Requests that repeat each other (an agent's loop, a template filled again and again, the
same question asked twice) write runs an earlier request already wrote; their own context
may not hold them yet.

**The table.** Keys are n-grams of ``prompt_lookup_min`` to ``prompt_lookup_max`` tokens;
a key's value is the most recent continuation seen after it (up to ``num_speculative_tokens``
tokens). It is filled in :meth:`SuffixProposer.finish_requests`, from the outputs of the
requests that finished: for every output position, each n-gram ending just before it
(which may reach back into the prompt) maps to the tokens from that position on. So a
request learns nothing from itself or from the requests beside it in a batch while they
run (their drafts do not depend on each other), and later outputs replace earlier ones.
The table holds at most :attr:`SuffixProposer.max_table_entries` keys; the least recently
written or used is dropped first (an LRU).

**Outputs it remembers.** To learn from a request when it finishes, the proposer keeps the
output tokens it has seen in :meth:`propose` (and the prompt's last ``prompt_lookup_max``
tokens), copied as they arrive (the engine's lists are not held on to): a request it was
never asked about (in a step where speculation was off) teaches it nothing. This memory is
released by :meth:`finish_requests`.

**Lookup.** The request's own tokens first (exactly ``ngram``); where they hold no match,
the table's entry for the longest suffix of the request (``prompt_lookup_max`` tokens down
to ``prompt_lookup_min``) that it holds.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from vlite.core.hookspecs import hookimpl
from vlite.core.proposer import DraftRequest, SpeculativeConfig
from vlite.plugins.proposers.ngram import NgramProposer


@dataclass
class SeenTokens:
    """The tokens of a running request the table will learn from when it finishes.

    Attributes:
        start: the position in the request's tokens of ``tokens[0]``.
        num_prompt_tokens: how many of the request's tokens are the prompt.
        tokens: the request's tokens from ``start`` on, as seen so far.
    """

    start: int
    num_prompt_tokens: int
    tokens: list[int] = field(default_factory=list)

    def catch_up(self, token_ids: Sequence[int]) -> None:
        """Copy the tokens added since the last call (a request's tokens only grow)."""
        known = self.start + len(self.tokens)
        if len(token_ids) > known:
            self.tokens.extend(int(t) for t in token_ids[known:])


class SuffixTable:
    """n-gram -> the latest continuation seen after it, at most ``max_entries`` of them
    (least recently written or read dropped first)."""

    def __init__(self, max_entries: int) -> None:
        self.max_entries = max_entries
        self.entries: OrderedDict[tuple[int, ...], tuple[int, ...]] = OrderedDict()

    def __len__(self) -> int:
        return len(self.entries)

    def put(self, key: tuple[int, ...], continuation: tuple[int, ...]) -> None:
        self.entries[key] = continuation
        self.entries.move_to_end(key)
        while len(self.entries) > self.max_entries:
            self.entries.popitem(last=False)

    def get(self, key: tuple[int, ...]) -> tuple[int, ...] | None:
        continuation = self.entries.get(key)
        if continuation is not None:
            self.entries.move_to_end(key)
        return continuation


class SuffixProposer(NgramProposer):
    """Prompt lookup, then the continuations finished requests wrote after the same n-gram.

    Attributes:
        max_table_entries: the most n-grams the table keeps (a subclass may change it);
            each holds at most ``num_speculative_tokens`` tokens.
    """

    learns_across_requests = True
    max_table_entries = 65536

    def __init__(self, config: SpeculativeConfig) -> None:
        super().__init__(config)
        self.table = SuffixTable(self.max_table_entries)
        self.seen: dict[str, SeenTokens] = {}

    def propose(self, requests: Sequence[DraftRequest]) -> dict[str, list[int]]:
        drafts = {}
        for request in requests:
            self.remember(request)
            tokens = np.asarray(request.token_ids, dtype=np.int64)
            found = self.lookup(tokens, request.max_drafts) or self.recall(
                request.token_ids, request.max_drafts
            )
            if found:
                drafts[request.request_id] = found
        return drafts

    def remember(self, request: DraftRequest) -> None:
        """Copy the request's new tokens into :attr:`seen`."""
        seen = self.seen.get(request.request_id)
        if seen is None:
            start = max(0, request.num_prompt_tokens - self.config.prompt_lookup_max)
            seen = self.seen[request.request_id] = SeenTokens(start, request.num_prompt_tokens)
        seen.catch_up(request.token_ids)

    def recall(self, token_ids: Sequence[int], max_drafts: int) -> list[int]:
        """The table's continuation of the longest suffix of ``token_ids`` it holds."""
        config = self.config
        for n in range(config.prompt_lookup_max, config.prompt_lookup_min - 1, -1):
            if len(token_ids) < n:
                continue
            continuation = self.table.get(tuple(int(t) for t in token_ids[-n:]))
            if continuation:
                return list(continuation[:max_drafts])
        return []

    def finish_requests(self, request_ids: Sequence[str]) -> None:
        """Learn from the outputs of ``request_ids`` (those it saw), then forget them."""
        for request_id in request_ids:
            seen = self.seen.pop(request_id, None)
            if seen is not None:
                self.learn(seen)

    def learn(self, seen: SeenTokens) -> None:
        """Map each n-gram before an output position to the tokens from there on; later
        positions are written last, so the latest continuation wins."""
        config, tokens = self.config, seen.tokens
        first_output = max(0, seen.num_prompt_tokens - seen.start)
        for position in range(first_output, len(tokens)):
            continuation = tuple(tokens[position : position + config.num_speculative_tokens])
            for n in range(config.prompt_lookup_min, config.prompt_lookup_max + 1):
                if position >= n:
                    self.table.put(tuple(tokens[position - n : position]), continuation)


@hookimpl
def register_proposers(register):
    register("suffix", SuffixProposer)
