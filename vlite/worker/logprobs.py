"""Log-probabilities of sampled tokens and their top alternatives (vLLM's "raw logprobs").

Computed from the model's logits before penalties, temperature and stop-token masks,
only for the rows that asked: a step in which no request wants logprobs computes none.
"""

from __future__ import annotations

import torch

from vlite.core.outputs import SampledLogprobs


class LogprobsRequest:
    """Which rows of a step want logprobs, and the raw log-softmax of those rows.

    Take it (:meth:`capture`) before the logits are masked or handed to the sampler, and
    :meth:`gather` once the tokens are sampled.

    Args:
        rows: row indices that asked.
        num_top: ``k`` (the ``logprobs`` setting) of each of those rows.
        log_probs: ``[len(rows), vocab]`` float32 log-softmax of those rows' logits.
    """

    def __init__(self, rows: list[int], num_top: list[int], log_probs: torch.Tensor) -> None:
        self.rows = rows
        self.num_top = num_top
        self.log_probs = log_probs

    @classmethod
    def capture(
        cls, logits: torch.Tensor, num_top_by_row: list[int | None]
    ) -> LogprobsRequest | None:
        """The rows whose ``num_top_by_row`` entry is not ``None``; ``None`` if there are none.

        Args:
            logits: ``[n, vocab]`` float32 raw logits.
            num_top_by_row: ``[n]`` each row's ``logprobs`` setting.
        """
        rows = [row for row, k in enumerate(num_top_by_row) if k is not None]
        if not rows:
            return None
        num_top = [num_top_by_row[row] for row in rows]
        index = torch.tensor(rows, dtype=torch.int64, device=logits.device)
        log_probs = logits.index_select(0, index).float().log_softmax(dim=-1)
        return cls(rows, num_top, log_probs)

    def gather(self, sampled: torch.Tensor) -> list[SampledLogprobs]:
        """One :class:`SampledLogprobs` per requesting row, in :attr:`rows` order.

        Args:
            sampled: ``[n]`` int64 tokens sampled for every row of the step.
        """
        device = self.log_probs.device
        row_index = torch.tensor(self.rows, dtype=torch.int64, device=device)
        token_ids = sampled.index_select(0, row_index).unsqueeze(1)  # [m, 1]
        token_logprobs = self.log_probs.gather(1, token_ids)  # [m, 1]
        # Rank 1 is the most likely token; ties share the better rank.
        ranks = (self.log_probs > token_logprobs).sum(dim=1, keepdim=True) + 1
        max_top = max(self.num_top)
        if max_top:
            top_logprobs, top_ids = self.log_probs.topk(max_top, dim=-1)
            top_ranks = torch.arange(1, max_top + 1, device=device).expand(len(self.rows), -1)
            token_ids = torch.cat([token_ids, top_ids], dim=1)
            token_logprobs = torch.cat([token_logprobs, top_logprobs], dim=1)
            ranks = torch.cat([ranks, top_ranks], dim=1)
        ids_list, logprobs_list, ranks_list = (
            token_ids.tolist(),
            token_logprobs.tolist(),
            ranks.tolist(),
        )
        return [
            SampledLogprobs(ids[: k + 1], logprobs[: k + 1], row_ranks[: k + 1])
            for ids, logprobs, row_ranks, k in zip(
                ids_list, logprobs_list, ranks_list, self.num_top
            )
        ]
