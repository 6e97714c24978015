"""The ``ngram`` proposer (prompt lookup): the tokens that followed the context's latest
suffix where it occurred before.

For ``n`` from ``prompt_lookup_max`` down to ``prompt_lookup_min``, the last ``n`` known tokens
are looked for earlier in the request's own tokens (prompt and output); at the latest
earlier occurrence of the longest suffix found, the tokens after it are the drafts. Work
that copies from its input (editing code, quoting a text, filling a record from a document)
repeats long runs of it, which one step then verifies at once.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from vlite.core.hookspecs import hookimpl
from vlite.core.proposer import DraftRequest, Proposer


class NgramProposer(Proposer):
    """Prompt lookup over each request's own tokens (no state between steps)."""

    def propose(self, requests: Sequence[DraftRequest]) -> dict[str, list[int]]:
        drafts = {}
        for request in requests:
            found = self.lookup(np.asarray(request.token_ids, dtype=np.int64), request.max_drafts)
            if found:
                drafts[request.request_id] = found
        return drafts

    def lookup(self, tokens: np.ndarray, max_drafts: int) -> list[int]:
        """The drafts for a context ``tokens`` ``[L]``: at most ``max_drafts`` tokens."""
        config = self.config
        for n in range(config.prompt_lookup_max, config.prompt_lookup_min - 1, -1):
            if len(tokens) <= n:
                continue
            windows = np.lib.stride_tricks.sliding_window_view(tokens[:-1], n)
            matches = np.flatnonzero((windows == tokens[-n:]).all(axis=1))
            if len(matches):
                start = int(matches[-1]) + n
                return tokens[start : start + max_drafts].tolist()
        return []


@hookimpl
def register_proposers(register):
    register("ngram", NgramProposer)
