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
        bitmask: one packed row per sampled row of each structured request that samples
            this step (a request that verifies drafts has several: its rows in order).

    Raises:
        RuntimeError: the bitmask's rows do not match the rows sampled (the core and the
            worker disagree: a bug).
    """
    rows_of: dict[str, list[int]] = {}
    for row, request_id in enumerate(row_request_ids):
        rows_of.setdefault(request_id, []).append(row)
    taken = {request_id: 0 for request_id in rows_of}
    rows = []
    for request_id in bitmask.request_ids:
        index = taken.get(request_id, 0)
        if request_id not in rows_of or index >= len(rows_of[request_id]):
            raise RuntimeError(
                f"grammar bitmask row {len(rows)} is for request {request_id!r}, which samples "
                f"{len(rows_of.get(request_id, ()))} rows this step"
            )
        rows.append(rows_of[request_id][index])
        taken[request_id] = index + 1
    packed = np.frombuffer(bitmask.data, dtype=np.int32).reshape(len(bitmask.request_ids), -1)
    words = torch.from_numpy(packed.copy()).to(logits.device)
    forbidden = ~allowed_tokens(words, logits.shape[-1])
    if rows == list(range(logits.shape[0])):  # every row, in order: no gather or scatter
        logits.masked_fill_(forbidden, float("-inf"))
        return
    index = torch.tensor(rows, device=logits.device)
    logits[index] = logits[index].masked_fill(forbidden, float("-inf"))
