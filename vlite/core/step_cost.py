"""StepCostModel: what a step costs, learnt from the steps the engine ran.

The scheduler holds running streams to an inter-token target (``max_itl_ms``) by capping
the prompt tokens a step carries beside decodes. The cap comes from two figures measured on
the steps already run, each an exponential moving average:

* the wall time of a decode-only step, per number of decode tokens in it (a batch of 8
  and a batch of 3 cost differently: the products' kernels, the replay's padded sizes);
* the time one prompt token adds to a step: a step's time less its decodes' time, over its
  prompt tokens (a prompt-only step counts whole).

A step of ``d`` decode tokens may then carry ``(target - decode_time(d)) / per_token``
prompt tokens. Until both figures exist the model has no answer and the step takes what
the budget allows, which is what gives it its first observations.

Speculative decoding asks the other way round (:mod:`vlite.core.draft_budget`): what a
decode step of ``d`` tokens (its requests' last tokens and their drafts) would cost, for
sizes not run yet too: :meth:`StepCostModel.estimated_decode_seconds`.
"""

from __future__ import annotations

import bisect
import math

#: Weight of the newest observation in each moving average.
SMOOTHING = 0.25


class StepCostModel:
    """Decode-step times and the cost of a prompt token, from observed steps."""

    def __init__(self, smoothing: float = SMOOTHING) -> None:
        if not 0 < smoothing <= 1:
            raise ValueError(f"smoothing={smoothing!r}; allowed: 0 < smoothing <= 1")
        self.smoothing = smoothing
        #: Decode tokens in a decode-only step -> its average wall seconds.
        self._decode_seconds: dict[int, float] = {}
        #: Its keys, ascending.
        self._sizes: list[int] = []
        #: Average seconds one prompt token adds to a step (None: none observed yet).
        self.seconds_per_prompt_token: float | None = None

    def observe(self, num_decode_tokens: int, num_prompt_tokens: int, seconds: float) -> None:
        """Take one finished step: its decode and prompt tokens and its wall seconds."""
        if seconds <= 0 or num_decode_tokens + num_prompt_tokens == 0:
            return
        if num_prompt_tokens == 0:
            previous = self._decode_seconds.get(num_decode_tokens)
            if previous is None:
                bisect.insort(self._sizes, num_decode_tokens)
            self._decode_seconds[num_decode_tokens] = self._average(previous, seconds)
            return
        decode_seconds = self.decode_seconds(num_decode_tokens) if num_decode_tokens else 0.0
        if decode_seconds is None:
            return  # no decode-only step of that size yet: the prompt's share is unknown
        per_token = max(seconds - decode_seconds, 0.0) / num_prompt_tokens
        self.seconds_per_prompt_token = self._average(self.seconds_per_prompt_token, per_token)

    def decode_seconds(self, num_decode_tokens: int) -> float | None:
        """Average seconds of a decode-only step of that many decode tokens: the size
        itself, else the nearest larger size observed, else the largest (a cost grows with
        the batch); None before any decode-only step."""
        if not self._sizes:
            return None
        index = min(bisect.bisect_left(self._sizes, num_decode_tokens), len(self._sizes) - 1)
        return self._decode_seconds[self._sizes[index]]

    def estimated_decode_seconds(self, num_decode_tokens: int) -> float | None:
        """Seconds of a decode-only step of that many decode tokens, interpolated between
        the nearest sizes observed; beyond them, the nearest size's (above the largest that
        is optimistic, so a larger step gets tried and measured); None before any
        decode-only step."""
        sizes = self._sizes
        if not sizes:
            return None
        index = bisect.bisect_left(sizes, num_decode_tokens)
        if index == len(sizes) or sizes[index] == num_decode_tokens or index == 0:
            return self._decode_seconds[sizes[min(index, len(sizes) - 1)]]
        low, high = sizes[index - 1], sizes[index]
        share = (num_decode_tokens - low) / (high - low)
        low_seconds, high_seconds = self._decode_seconds[low], self._decode_seconds[high]
        return low_seconds + share * (high_seconds - low_seconds)

    def prompt_tokens_within(self, seconds: float, num_decode_tokens: int) -> int | None:
        """How many prompt tokens a step of ``num_decode_tokens`` decode tokens can carry
        and still take at most ``seconds`` (0 when its decodes alone take that long);
        None while either figure is unknown."""
        decode_seconds = self.decode_seconds(num_decode_tokens)
        per_token = self.seconds_per_prompt_token
        if decode_seconds is None or not per_token:
            return None
        # (a hair over, so that 0.02 / 0.001 makes 20 and not 19.999...)
        return max(math.floor((seconds - decode_seconds) / per_token + 1e-9), 0)

    def _average(self, previous: float | None, value: float) -> float:
        if previous is None:
            return value
        return previous + self.smoothing * (value - previous)
