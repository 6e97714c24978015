"""The sampler interface and the per-step sampling inputs (``register_samplers``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass
class SamplingMetadata:
    """Sampling settings of the ``n`` rows of a step's logits, as tensors on the device.

    Attributes:
        temperature: ``[n]`` float32; 0 marks a greedy row.
        top_k: ``[n]`` int64; 0 disables top-k for that row.
        top_p: ``[n]`` float32; 1.0 disables top-p for that row.
        generators: row index -> the request's own ``torch.Generator`` (seeded requests);
            other random rows draw from the global generator.
        is_all_greedy: every row is greedy (no random numbers are drawn).
        has_top_k: some row uses top-k.
        has_top_p: some row uses top-p.
    """

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    generators: dict[int, torch.Generator]
    is_all_greedy: bool
    has_top_k: bool
    has_top_p: bool


class Sampler(Protocol):
    """Turns a step's logits into one token per row.

    Optional class attributes (capability flags, read by the conformance suite
    ``vlite.testing.SamplerConformance``; absent means ``True``):

    * ``is_deterministic``: a seeded row gives the same token for the same logits and
      seed, whatever else is in the batch.
    * ``supports_top_k`` / ``supports_top_p``: the row settings are honoured.
    """

    def sample(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """Pick tokens.

        Args:
            logits: ``[n, vocab_size]`` float32.
            metadata: the rows' settings.

        Returns:
            ``[n]`` int64 token ids on the same device. A greedy row must return the
            argmax; a seeded row must return the same token for the same logits and
            generator state.
        """
        ...
