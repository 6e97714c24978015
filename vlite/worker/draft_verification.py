"""Verifying draft tokens (speculative decoding): keep the drafts the model's own samples
agree with, and one sample more.

A request that verifies ``k`` drafts has ``k + 1`` sampled rows: row ``i`` holds the model's
distribution after its known tokens and the first ``i`` drafts. Each row is sampled as it
would be without speculation (the sampler plugin, the request's own settings); the drafts
are kept while each equals the sample of the row before it, and the first sample that
differs (or the one after the last draft) is the step's last token. For drafts that come
with no distribution of their own (n-gram lookups), this is the rejection rule of
speculative sampling with a draft distribution of one on the drafted token: a draft is
accepted with the model's probability of it, and a rejected position yields a sample of the
model's distribution without that token, so every token has the model's own distribution.
Greedy rows are the special case where the sample is the argmax.
"""

from __future__ import annotations

from concurrent.futures import Future

import torch

from vlite.core.outputs import ModelRunnerOutput
from vlite.worker.input_batch import CachedRequestState
from vlite.worker.logprobs import LogprobsRequest


def accepted_tokens(samples: list[int], drafts: list[int]) -> list[int]:
    """The tokens a request keeps from ``samples`` (``len(drafts) + 1`` of them, one per
    row): the samples up to and including the first that differs from its draft."""
    kept = 0
    while kept < len(drafts) and samples[kept] == drafts[kept]:
        kept += 1
    return samples[: kept + 1]


def drafts_before_rows(request_ids: list[str], drafts: dict[str, list[int]]) -> list[list[int]]:
    """Each sampled row's drafts before it: row ``i`` of a request with drafts ``d`` follows
    ``d[:i]`` (the context it is sampled after, as penalties count it)."""
    before: list[list[int]] = []
    row = 0
    while row < len(request_ids):
        own = drafts.get(request_ids[row], [])
        before += [own[:i] for i in range(len(own) + 1)]
        row += len(own) + 1
    return before


def verify_drafts(
    request_ids: list[str],
    states: list[CachedRequestState],
    sampled: torch.Tensor,
    drafts: dict[str, list[int]],
    logprobs: LogprobsRequest | None = None,
) -> Future[ModelRunnerOutput]:
    """The step's output, its tokens appended to the requests' states.

    Args:
        request_ids: each sampled row's request (a request's rows in one run).
        states: the state of each row's request.
        sampled: ``[rows]`` the sampled token of each row.
        drafts: request id -> the drafts it verified this step.
        logprobs: the rows that asked for logprobs: each kept token gets its row's.
    """
    samples = sampled.tolist()
    tokens: dict[str, list[int]] = {}
    row = 0
    while row < len(samples):
        request_id, state = request_ids[row], states[row]
        own = drafts.get(request_id, [])
        kept = accepted_tokens(samples[row : row + len(own) + 1], own)
        state.token_ids.extend(kept)
        tokens[request_id] = kept
        row += len(own) + 1
    output = ModelRunnerOutput(sampled_token_ids=tokens)
    if logprobs is not None:
        # A request's rows come in order, one per token it may keep: those of its kept ones.
        by_request: dict[str, list] = {}
        for r, entry in zip(logprobs.rows, logprobs.gather(sampled)):
            by_request.setdefault(request_ids[r], []).append(entry)
        output.logprobs = {
            request_id: entries[: len(tokens[request_id])]
            for request_id, entries in by_request.items()
        }
    done: Future[ModelRunnerOutput] = Future()
    done.set_result(output)
    return done
