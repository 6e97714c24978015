"""``default``: greedy, temperature, top-k, top-p and per-request seeds, vectorized."""

from __future__ import annotations

import torch

from vlite.core.hookspecs import hookimpl
from vlite.core.sampler import SamplingMetadata


class DefaultSampler:
    """Samples every row of a batch at once.

    Random rows are drawn with the exponential race: ``argmax(p / E)`` with
    ``E ~ Exp(1)`` picks token ``i`` with probability ``p_i``, and lets a seeded row draw
    its noise from its own generator while the rest share one draw.
    """

    # Capability flags (see vlite.core.sampler.Sampler).
    is_deterministic = True
    supports_top_k = True
    supports_top_p = True

    def sample(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        greedy_tokens = logits.argmax(dim=-1)
        if metadata.is_all_greedy:
            return greedy_tokens
        is_greedy = metadata.temperature == 0
        temperature = torch.where(is_greedy, 1.0, metadata.temperature)
        logits = logits / temperature.unsqueeze(1)
        if metadata.has_top_k:
            logits = apply_top_k(logits, metadata.top_k)
        if metadata.has_top_p:
            logits = apply_top_p(logits, metadata.top_p)
        probs = logits.softmax(dim=-1)
        random_tokens = (probs / exponential_noise(probs, metadata.generators)).argmax(dim=-1)
        return torch.where(is_greedy, greedy_tokens, random_tokens)


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
