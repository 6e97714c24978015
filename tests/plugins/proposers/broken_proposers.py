"""Deliberately broken proposers: ProposerConformance must fail on each.

Each is a small change to the built-in ``ngram`` proposer, of the kind a proposer author
could make by mistake. ``test_proposer_suite_catches_bugs.py`` runs the suite on them.
"""

from __future__ import annotations

import random

import numpy as np

from vlite.core.hookspecs import hookimpl
from vlite.plugins.proposers.ngram import NgramProposer


class OneTooManyProposer(NgramProposer):
    """Copies one token past ``max_drafts`` (an off-by-one in the slice)."""

    def lookup(self, tokens, max_drafts):
        return super().lookup(tokens, max_drafts + 1)


class NumpyIntsProposer(NgramProposer):
    """Returns ``list()`` of a numpy slice: a list of ``numpy.int64``, not of ints."""

    def lookup(self, tokens, max_drafts):
        return list(np.asarray(super().lookup(tokens, max_drafts), dtype=np.int64))


class FloatTokensProposer(NgramProposer):
    """Matches on a float32 copy of the tokens and returns floats from it."""

    def lookup(self, tokens, max_drafts):
        return [float(t) for t in super().lookup(tokens.astype(np.float32), max_drafts)]


class StaleIdsProposer(NgramProposer):
    """Keeps every draft it made in one dict and returns that dict: ids of earlier steps'
    requests are answered too."""

    def __init__(self, config):
        super().__init__(config)
        self.drafts = {}

    def propose(self, requests):
        self.drafts.update(super().propose(requests))
        return self.drafts


class RandomGuessProposer(NgramProposer):
    """Guesses random tokens where the context has no match, yet claims (by not saying
    otherwise) to be deterministic."""

    def __init__(self, config):
        super().__init__(config)
        self.rng = random.Random()

    def lookup(self, tokens, max_drafts):
        found = super().lookup(tokens, max_drafts)
        return found or [self.rng.randrange(1000) for _ in range(max_drafts)]


class BatchSearchingProposer(NgramProposer):
    """Where a request's own tokens have no match, looks its suffix up in the other requests
    of the batch: its drafts depend on what else is in the batch."""

    def propose(self, requests):
        contexts = {r.request_id: np.asarray(r.token_ids, dtype=np.int64) for r in requests}
        drafts = {}
        for request in requests:
            tokens = contexts[request.request_id]
            others = [c for rid, c in contexts.items() if rid != request.request_id]
            found = self.lookup(tokens, request.max_drafts) or self.search(
                tokens, others, request.max_drafts
            )
            if found:
                drafts[request.request_id] = found
        return drafts

    def search(self, tokens, others, max_drafts):
        for n in range(self.config.prompt_lookup_max, self.config.prompt_lookup_min - 1, -1):
            if len(tokens) < n:
                continue
            for other in others:
                if len(other) <= n:
                    continue
                windows = np.lib.stride_tricks.sliding_window_view(other[:-1], n)
                matches = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
                if len(matches):
                    start = int(matches[-1]) + n
                    return other[start : start + max_drafts].tolist()
        return []


@hookimpl
def register_proposers(register) -> None:
    register("one-too-many", OneTooManyProposer)
    register("numpy-ints", NumpyIntsProposer)
    register("float-tokens", FloatTokensProposer)
    register("stale-ids", StaleIdsProposer)
    register("random-guess", RandomGuessProposer)
    register("batch-searching", BatchSearchingProposer)
