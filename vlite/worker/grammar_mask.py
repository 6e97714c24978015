"""Applying the engine core's grammar bitmask to a step's logits (structured outputs)."""

from __future__ import annotations

import numpy as np
import torch

from vlite.core.outputs import GrammarBitmask
from vlite.core.structured_output import allowed_tokens


def apply_grammar_bitmask(
    logits: torch.Tensor, row_request_ids: list[str], bitmask: GrammarBitmask
) -> None:
    """Set to ``-inf``, in place, the logits of the tokens each structured row may not take.

    Args:
        logits: ``[rows, vocab_size]``, row ``i`` sampled for ``row_request_ids[i]``.
        row_request_ids: the request of each row.
        bitmask: one packed row per structured request that samples this step.

    Raises:
        RuntimeError: the bitmask names a request that does not sample this step (the core
            and the worker disagree: a bug).
    """
    row_of = {request_id: row for row, request_id in enumerate(row_request_ids)}
    missing = [rid for rid in bitmask.request_ids if rid not in row_of]
    if missing:
        raise RuntimeError(f"grammar bitmask rows for requests that do not sample: {missing}")
    packed = np.frombuffer(bitmask.data, dtype=np.int32).reshape(len(bitmask.request_ids), -1)
    words = torch.from_numpy(packed.copy()).to(logits.device)
    forbidden = ~allowed_tokens(words, logits.shape[-1])
    rows = [row_of[request_id] for request_id in bitmask.request_ids]
    if rows == list(range(logits.shape[0])):  # every row, in order: no gather or scatter
        logits.masked_fill_(forbidden, float("-inf"))
        return
    index = torch.tensor(rows, device=logits.device)
    logits[index] = logits[index].masked_fill(forbidden, float("-inf"))
