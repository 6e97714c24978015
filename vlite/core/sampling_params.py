"""SamplingParams: how to pick tokens and when to stop, validated on construction."""

from __future__ import annotations

from dataclasses import dataclass

_GREEDY_EPSILON = 1e-5


class SamplingParamsError(ValueError):
    """An invalid sampling option; ``param`` names the field (e.g. for an HTTP 400)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class SamplingParams:
    """Per-request decoding options, with vLLM's names and meanings.

    Attributes:
        max_tokens: Most new tokens to generate (>= 1).
        temperature: 0 means greedy; otherwise logits are divided by it (>= 0).
        top_p: Keep the smallest set of tokens whose probability reaches ``top_p`` (0, 1].
        top_k: Keep the ``top_k`` most likely tokens; 0 or -1 keeps all.
        seed: Seed for this request's own random generator; ``None`` uses the engine's.
        stop: Strings that end generation; the matched string is left out of the text.
            A single string is normalized to a one-element list.
        stop_token_ids: Token ids that end generation (the token is kept in ``token_ids``).
        ignore_eos: Keep generating past the end-of-sequence token.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        self._check(
            isinstance(self.max_tokens, int) and self.max_tokens >= 1,
            "max_tokens",
            "an integer >= 1",
        )
        self._check(
            isinstance(self.temperature, (int, float)) and self.temperature >= 0,
            "temperature",
            "a number >= 0",
        )
        self._check(
            isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1,
            "top_p",
            "a number in (0, 1]",
        )
        self._check(
            isinstance(self.top_k, int) and (self.top_k >= 0 or self.top_k == -1),
            "top_k",
            "an integer >= 0, or -1 (0 and -1 disable top-k)",
        )
        self._check(self.seed is None or isinstance(self.seed, int), "seed", "None or an integer")
        self.stop = self._normalize_stop(self.stop)
        ids = self.stop_token_ids or []
        self._check(
            all(isinstance(t, int) and t >= 0 for t in ids),
            "stop_token_ids",
            "a list of integers >= 0",
        )
        self.stop_token_ids = list(ids)
        if self.top_k == -1:
            self.top_k = 0

    def _check(self, is_ok: bool, name: str, allowed: str) -> None:
        if not is_ok:
            value = getattr(self, name)
            raise SamplingParamsError(
                f"SamplingParams.{name}={value!r} is invalid: must be {allowed}", name
            )

    def _normalize_stop(self, stop: list[str] | str | None) -> list[str]:
        strings = [stop] if isinstance(stop, str) else list(stop or [])
        self._check(
            all(isinstance(s, str) and s for s in strings),
            "stop",
            "a non-empty string or a list of non-empty strings",
        )
        return strings

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPSILON
