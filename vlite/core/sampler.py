"""The sampler interface and the per-step sampling inputs (``register_samplers``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from vlite.core.sampling_params import SamplingParams


@dataclass
class SamplingPenalties:
    """The penalties of a step's ``n`` rows, present only when some row uses one.

    Rows without penalties hold the neutral values (0, 0, 1), which change nothing.

    Attributes:
        presence_penalty: ``[n]`` float32; subtracted once if a token is in the output.
        frequency_penalty: ``[n]`` float32; subtracted once per occurrence in the output.
        repetition_penalty: ``[n]`` float32; for tokens in the prompt or the output,
            positive logits are divided by it and negative ones multiplied.
        prompt_token_ids: ``[n, max_prompt_len]`` int64, each row padded with
            ``vocab_size`` (an id outside the vocabulary).
        output_token_ids: ``[n, max_output_len]`` int64 (``max_output_len`` may be 0),
            padded with ``vocab_size``.
    """

    presence_penalty: torch.Tensor
    frequency_penalty: torch.Tensor
    repetition_penalty: torch.Tensor
    prompt_token_ids: torch.Tensor
    output_token_ids: torch.Tensor


@dataclass
class SamplingMetadata:
    """Sampling settings of the ``n`` rows of a step's logits, as tensors on the device.

    The fields after ``has_top_p`` have neutral defaults, so a sampler (or a test) that
    builds metadata without them gets a batch in which no row uses those features.

    Attributes:
        temperature: ``[n]`` float32; 0 marks a greedy row.
        top_k: ``[n]`` int64; 0 disables top-k for that row.
        top_p: ``[n]`` float32; 1.0 disables top-p for that row.
        generators: row index -> the request's own ``torch.Generator`` (seeded requests);
            other random rows draw from the global generator.
        is_all_greedy: every row is greedy (no random numbers are drawn).
        has_top_k: some row uses top-k.
        has_top_p: some row uses top-p.
        min_p: ``[n]`` float32 in [0, 1] (0 disables it), or ``None`` when no row uses it.
        penalties: the rows' penalties and token histories, or ``None`` when no row uses
            a penalty (then sampling costs nothing extra).
    """

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    generators: dict[int, torch.Generator]
    is_all_greedy: bool
    has_top_k: bool
    has_top_p: bool
    min_p: torch.Tensor | None = field(default=None)
    penalties: SamplingPenalties | None = field(default=None)

    @property
    def has_min_p(self) -> bool:
        return self.min_p is not None

    @property
    def has_penalties(self) -> bool:
        return self.penalties is not None


class Sampler(Protocol):
    """Turns a step's logits into one token per row.

    Optional class attributes (capability flags, read by the conformance suite
    ``vlite.testing.SamplerConformance`` and by the engine, which rejects a request that
    uses a feature its sampler does not claim; see :data:`SAMPLER_CAPABILITY_DEFAULTS`
    for what an absent flag means):

    * ``is_deterministic``: a seeded row gives the same token for the same logits and
      seed, whatever else is in the batch.
    * ``supports_top_k`` / ``supports_top_p``: the row settings are honoured.
    * ``supports_min_p``: ``metadata.min_p`` is honoured.
    * ``supports_penalties``: ``metadata.penalties`` are applied to the logits first, on
      greedy rows too (the argmax is taken after them).

    Not the sampler's business: ``min_tokens`` (the model runner sets the logits of the
    stop tokens to ``-inf`` before calling :meth:`sample`) and ``logprobs`` (computed by
    the model runner from the raw logits), so every sampler supports both.
    """

    def sample(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """Pick tokens.

        Args:
            logits: ``[n, vocab_size]`` float32. The sampler may change it in place.
            metadata: the rows' settings.

        Returns:
            ``[n]`` int64 token ids on the same device. A greedy row must return the
            argmax (after penalties); a seeded row must return the same token for the
            same logits and generator state.
        """
        ...


#: What an absent capability flag means: the original features are assumed, the later
#: ones must be claimed (a sampler written before they existed ignores their settings).
SAMPLER_CAPABILITY_DEFAULTS: dict[str, bool] = {
    "is_deterministic": True,
    "supports_top_k": True,
    "supports_top_p": True,
    "supports_min_p": False,
    "supports_penalties": False,
}


def sampler_claims(sampler_cls: Any, flag: str) -> bool:
    """Whether ``sampler_cls`` claims capability ``flag`` (absent: the documented default)."""
    return bool(getattr(sampler_cls, flag, SAMPLER_CAPABILITY_DEFAULTS[flag]))


def unsupported_sampling_options(sampler_cls: Any, params: SamplingParams) -> list[str]:
    """The options ``params`` uses that ``sampler_cls`` does not claim to honour."""
    uses = {
        "top_k": ("supports_top_k", params.top_k > 0),
        "top_p": ("supports_top_p", params.top_p < 1.0),
        "min_p": ("supports_min_p", params.min_p > 0),
        "presence_penalty": ("supports_penalties", params.presence_penalty != 0),
        "frequency_penalty": ("supports_penalties", params.frequency_penalty != 0),
        "repetition_penalty": ("supports_penalties", params.repetition_penalty != 1.0),
    }
    if params.is_greedy:  # only penalties change a greedy row's token
        uses = {name: use for name, use in uses.items() if name.endswith("penalty")}
    return [
        name
        for name, (flag, is_used) in uses.items()
        if is_used and not sampler_claims(sampler_cls, flag)
    ]
