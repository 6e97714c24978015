"""Presence, frequency and repetition penalties (vLLM's meanings), vectorized over rows."""

from __future__ import annotations

import torch

from vlite.core.sampler import SamplingPenalties


def token_counts(token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """How often each vocabulary token occurs in each row.

    Args:
        token_ids: ``[n, length]`` int64, padded with ``vocab_size``.
        vocab_size: the vocabulary size.

    Returns:
        ``[n, vocab_size]`` int32 counts (the padding is dropped).
    """
    counts = torch.zeros(
        token_ids.shape[0], vocab_size + 1, dtype=torch.int32, device=token_ids.device
    )
    counts.scatter_add_(1, token_ids, torch.ones_like(token_ids, dtype=torch.int32))
    return counts[:, :vocab_size]


def apply_penalties(logits: torch.Tensor, penalties: SamplingPenalties) -> torch.Tensor:
    """Penalize tokens already seen, on the raw logits.

    * repetition (tokens of the prompt or the output): a positive logit is divided by
      the penalty, a negative one multiplied by it;
    * then frequency and presence (tokens of the output only):
      ``logit -= frequency_penalty * count + presence_penalty * (count > 0)``.

    Rows with neutral values (0, 0, 1) come out unchanged.

    Args:
        logits: ``[n, vocab]`` float32.
        penalties: the rows' penalties and token histories.

    Returns:
        ``[n, vocab]`` float32 (a new tensor).
    """
    vocab_size = logits.shape[-1]
    output_counts = token_counts(penalties.output_token_ids, vocab_size)
    is_in_output = output_counts > 0
    is_seen = token_counts(penalties.prompt_token_ids, vocab_size) > 0
    is_seen |= is_in_output
    repetition = penalties.repetition_penalty.unsqueeze(1)
    penalized = torch.where(logits > 0, logits / repetition, logits * repetition)
    logits = torch.where(is_seen, penalized, logits)
    logits = logits - penalties.frequency_penalty.unsqueeze(1) * output_counts
    return logits - penalties.presence_penalty.unsqueeze(1) * is_in_output
