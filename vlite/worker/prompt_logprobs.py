"""Prompt logprobs: each prompt token's log-probability after the tokens before it.

A request with ``SamplingParams.prompt_logprobs`` set has the logits of every row of its
prompt chunks computed (not only the row that samples): row ``p - 1`` gives the
distribution of prompt position ``p``, whose token is known. Like sampled logprobs they are
taken from the raw logits (see :mod:`vlite.worker.logprobs`), a slice of rows at a time so
that a long chunk never holds ``[rows, vocab]`` logits for all its rows at once.
"""

from __future__ import annotations

import torch

from vlite.core.outputs import PromptLogprobs
from vlite.worker.input_batch import CachedRequestState
from vlite.worker.logprobs import LogprobsRequest

#: Rows whose logits are computed together (``[ROWS_PER_SLICE, vocab]`` float32 at a time).
ROWS_PER_SLICE = 256


def prompt_logprobs(
    model,
    hidden: torch.Tensor,
    states: list[CachedRequestState],
    num_scheduled: list[int],
    num_computed: list[int],
) -> dict[str, PromptLogprobs]:
    """The prompt logprobs of the step's requests that asked for them.

    Args:
        model: the :class:`~vlite.core.model.CausalLM` (its ``compute_logits``).
        hidden: ``[num_tokens, hidden]`` the step's hidden states, requests end to end.
        states: the step's requests, in batch order.
        num_scheduled: tokens each computed this step.
        num_computed: tokens each had computed before the step.
    """
    results: dict[str, PromptLogprobs] = {}
    start = 0
    for state, count, computed in zip(states, num_scheduled, num_computed):
        num_top = state.sampling_params.prompt_logprobs
        # Rows computed..end-1 predict prompt positions computed+1..end.
        end = min(computed + count, state.num_prompt_tokens - 1)
        if num_top is not None and end > computed:
            rows = hidden[start : start + end - computed]
            tokens = state.token_ids[computed + 1 : end + 1]
            results[state.request_id] = PromptLogprobs(
                computed + 1, _entries(model, rows, tokens, num_top)
            )
        start += count
    return results


def _entries(model, rows: torch.Tensor, tokens: list[int], num_top: int) -> list:
    entries = []
    for first in range(0, len(tokens), ROWS_PER_SLICE):
        logits = model.compute_logits(rows[first : first + ROWS_PER_SLICE])
        known = torch.tensor(tokens[first : first + ROWS_PER_SLICE], device=logits.device)
        captured = LogprobsRequest.capture(logits, [num_top] * len(known))
        entries += captured.gather(known)
    return entries
