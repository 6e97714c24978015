"""``default``: penalties, greedy, temperature, min-p, top-k, top-p and per-request seeds,
vectorized over the batch."""

from __future__ import annotations

import torch

from vlite.core.hookspecs import hookimpl
from vlite.core.sampler import SamplingMetadata
from vlite.plugins.samplers.penalties import apply_penalties


class DefaultSampler:
    """Samples every row of a batch at once.

    Random rows are drawn with the exponential race: ``argmax(p / E)`` with
    ``E ~ Exp(1)`` picks token ``i`` with probability ``p_i``, and lets a seeded row draw
    its noise from its own generator while the rest share one draw.

    The order is vLLM's: penalties on the raw logits (greedy rows too), then temperature,
    then min-p, top-k and top-p. A feature no row of the batch uses costs nothing.
    """

    # Capability flags (see vlite.core.sampler.Sampler).
    is_deterministic = True
    supports_top_k = True
    supports_top_p = True
    supports_min_p = True
    supports_penalties = True

    def sample(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        if metadata.penalties is not None:
            logits = apply_penalties(logits, metadata.penalties)
        greedy_tokens = logits.argmax(dim=-1)
        if metadata.is_all_greedy:
            return greedy_tokens
        is_greedy = metadata.temperature == 0
        temperature = torch.where(is_greedy, 1.0, metadata.temperature)
        logits = logits / temperature.unsqueeze(1)
        if metadata.min_p is not None:
            logits = apply_min_p(logits, metadata.min_p)
        if metadata.has_top_k:
            logits = apply_top_k(logits, metadata.top_k)
        if metadata.has_top_p:
            logits = apply_top_p(logits, metadata.top_p)
        probs = logits.softmax(dim=-1)
        random_tokens = (probs / exponential_noise(probs, metadata.generators)).argmax(dim=-1)
        return torch.where(is_greedy, greedy_tokens, random_tokens)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask tokens less likely than ``min_p`` times each row's most likely token.

    Compared in log space (``logit - max_logit < log(min_p)``), which needs no softmax;
    ``min_p == 0`` gives ``-inf`` and keeps every token.

    Args:
        logits: ``[n, vocab]`` (temperature already applied).
        min_p: ``[n]`` float32 in [0, 1].
    """
    max_logits = logits.amax(dim=-1, keepdim=True)
    return logits.masked_fill(logits - max_logits < min_p.log().unsqueeze(1), float("-inf"))


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Mask all but each row's ``top_k`` largest logits (``top_k == 0``: keep all).

    Args:
        logits: ``[n, vocab]``.
        top_k: ``[n]`` int64.
    """
    vocab_size = logits.shape[-1]
    k = torch.where(top_k <= 0, vocab_size, top_k).clamp(max=vocab_size)
    sorted_logits = logits.sort(dim=-1, descending=True).values
    kth_largest = sorted_logits.gather(-1, (k - 1).unsqueeze(1))
    return logits.masked_fill(logits < kth_largest, float("-inf"))


def apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep each row's smallest set of most likely tokens whose mass reaches ``top_p``.

    Args:
        logits: ``[n, vocab]``.
        top_p: ``[n]`` float32 in (0, 1].
    """
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    sorted_probs = sorted_logits.softmax(dim=-1)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    drop_sorted = mass_before >= top_p.unsqueeze(1)
    drop_sorted[:, 0] = False  # the most likely token always survives
    drop = torch.empty_like(drop_sorted).scatter_(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def exponential_noise(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """``[n, vocab]`` samples of Exp(1); seeded rows use their own generators."""
    noise = torch.empty_like(probs).exponential_()
    for row, generator in generators.items():
        noise[row].exponential_(generator=generator)
    return noise


@hookimpl
def register_samplers(register):
    register("default", DefaultSampler)
