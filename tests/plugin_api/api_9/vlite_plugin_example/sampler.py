"""``multinomial``: temperature, top-k and top-p on sorted probabilities, then a draw."""

import torch

from vlite.core.sampler import SamplingMetadata


class MultinomialSampler:
    """Sorts each row once, applies temperature, top-k then top-p (vLLM's order) to the
    sorted probabilities, and draws with ``torch.multinomial``; a seeded row draws from
    its own generator, so its token does not depend on the rest of the batch.
    """

    # Capability flags, read by vlite's conformance suite and engine. Not claimed (absent
    # means False): supports_min_p, supports_penalties, so the engine rejects requests
    # that use them and the suite skips their tests.
    is_deterministic = True
    supports_top_k = True
    supports_top_p = True

    def sample(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """``logits`` ``[n, vocab]`` float32 -> ``[n]`` int64 token ids."""
        greedy_tokens = logits.argmax(dim=-1)
        if metadata.is_all_greedy:
            return greedy_tokens
        is_greedy = metadata.temperature == 0
        temperature = torch.where(is_greedy, 1.0, metadata.temperature)
        sorted_logits, order = (logits / temperature[:, None]).sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        vocab_size = logits.shape[-1]
        if metadata.has_top_k:
            top_k = torch.where(metadata.top_k > 0, metadata.top_k, vocab_size)
            ranks = torch.arange(vocab_size, device=logits.device)
            probs = probs * (ranks[None, :] < top_k[:, None])
            probs = probs / probs.sum(dim=-1, keepdim=True)
        if metadata.has_top_p:
            mass_before = probs.cumsum(dim=-1) - probs
            keep = mass_before < metadata.top_p[:, None]
            keep[:, 0] = True  # the most likely token always survives
            probs = probs * keep
        ranks_drawn = self._draw(probs, metadata.generators)
        random_tokens = order.gather(-1, ranks_drawn[:, None]).squeeze(-1)
        return torch.where(is_greedy, greedy_tokens, random_tokens)

    @staticmethod
    def _draw(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
        """One index per row of ``probs`` ``[n, vocab]`` (rows need not sum to one)."""
        drawn = torch.multinomial(probs, 1).squeeze(-1)
        for row, generator in generators.items():
            drawn[row] = torch.multinomial(probs[row], 1, generator=generator)[0]
        return drawn
