"""SamplingParams: how to pick tokens and when to stop, validated on construction."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, fields
from typing import Any

from vlite.core.errors import InvalidRequestError
from vlite.core.structured_output_params import StructuredOutputsParams

_GREEDY_EPSILON = 1e-5
#: The most alternatives ``logprobs`` may ask for per token (OpenAI's limit too).
MAX_LOGPROBS = 20
#: The largest bias ``logit_bias`` may add or subtract (OpenAI's limit too).
MAX_LOGIT_BIAS = 100.0


class SamplingParamsError(InvalidRequestError):
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
        n: Independent samples of the prompt to generate (>= 1); ``RequestOutput.outputs``
            holds one CompletionOutput per sample. With a ``seed``, sample ``i`` uses
            ``seed + i`` so the samples differ but repeat.
        presence_penalty: Subtracted once from the logit of every token already in the
            output, in [-2, 2] (0 is off; > 0 favours new tokens).
        frequency_penalty: Subtracted from a token's logit once per time it is already in
            the output, in [-2, 2] (0 is off).
        repetition_penalty: Tokens of the prompt or the output have positive logits divided
            and negative ones multiplied by it; > 0 (1 is off; > 1 discourages repeats).
        min_p: Drop tokens whose probability is below ``min_p`` times the most likely
            token's, in [0, 1] (0 is off).
        min_tokens: The end-of-sequence token, ``stop_token_ids`` and stop strings cannot
            end the request before this many output tokens (>= 0, <= ``max_tokens``).
        logprobs: Return the log-probability of each sampled token and of the ``logprobs``
            most likely tokens at its position (0 <= logprobs <= ``MAX_LOGPROBS``), from the
            model's raw logits (before penalties and temperature); ``None``: none.
        prompt_logprobs: Return, for every prompt token but the first, its log-probability
            after the tokens before it and the ``prompt_logprobs`` most likely tokens there
            (0 <= prompt_logprobs <= ``MAX_LOGPROBS``; vLLM's meaning). Such a request does
            not read the prefix cache (a cached prefix has no logits); ``None``: none.
        structured_outputs: ``None``, or the shape the output must have (a JSON schema, a
            regex, choices, a grammar: :class:`StructuredOutputsParams`, or a dict of its
            fields). The request is finished with ``"stop"`` when the shape is complete.
        logit_bias: token id -> a bias in [-100, 100] added to its logit before sampling.
        allowed_token_ids: Only these token ids may be sampled.
        bad_words: Words that may not be generated: a word's last token is banned where the
            output ends with the word's other tokens (the front end tokenizes them into
            ``bad_words_token_ids``, with and without a leading space).
        bad_words_token_ids: the token sequences ``bad_words`` becomes (set by the front
            end; may be given directly as token ids).
        extra_args: free-form settings for logits-processor plugins (each reads its key).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    min_tokens: int = 0
    logprobs: int | None = None
    structured_outputs: StructuredOutputsParams | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    bad_words_token_ids: list[list[int]] | None = None
    extra_args: dict[str, Any] | None = None
    prompt_logprobs: int | None = None

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
        self._check_extended_fields()

    def _check_extended_fields(self) -> None:
        """The options beyond the basic ones: n, penalties, min_p, min_tokens, logprobs."""
        self._check(_is_int(self.n) and self.n >= 1, "n", "an integer >= 1")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            self._check(_is_number(value) and -2 <= value <= 2, name, "a number in [-2, 2]")
        self._check(
            _is_number(self.repetition_penalty) and self.repetition_penalty > 0,
            "repetition_penalty",
            "a number > 0 (1 disables it)",
        )
        self._check(_is_number(self.min_p) and 0 <= self.min_p <= 1, "min_p", "a number in [0, 1]")
        self._check(
            _is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens,
            "min_tokens",
            f"an integer >= 0 and <= max_tokens ({self.max_tokens})",
        )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            self._check(
                value is None or (_is_int(value) and 0 <= value <= MAX_LOGPROBS),
                name,
                f"None or an integer in [0, {MAX_LOGPROBS}]",
            )
        self._check_output_controls()

    def _check_output_controls(self) -> None:
        """structured_outputs, logit_bias, allowed_token_ids, bad_words, extra_args."""
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        self._check(
            self.structured_outputs is None
            or isinstance(self.structured_outputs, StructuredOutputsParams),
            "structured_outputs",
            "None, a StructuredOutputsParams, or a dict of its fields",
        )
        if self.logit_bias is not None:
            self._check(
                isinstance(self.logit_bias, dict)
                and all(_is_token_id(k) for k in self.logit_bias)
                and all(
                    _is_number(v) and abs(v) <= MAX_LOGIT_BIAS for v in self.logit_bias.values()
                ),
                "logit_bias",
                f"a dict of token id (int >= 0) -> bias in ±{MAX_LOGIT_BIAS:g}",
            )
            self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()} or None
        self._check(
            self.allowed_token_ids is None
            or (
                isinstance(self.allowed_token_ids, list)
                and self.allowed_token_ids
                and all(map(_is_token_id, self.allowed_token_ids))
            ),
            "allowed_token_ids",
            "None or a non-empty list of token ids (int >= 0)",
        )
        self._check(
            self.bad_words is None
            or (
                isinstance(self.bad_words, list)
                and all(isinstance(w, str) and w for w in self.bad_words)
            ),
            "bad_words",
            "None or a list of non-empty strings",
        )
        self._check(
            self.bad_words_token_ids is None
            or (
                isinstance(self.bad_words_token_ids, list)
                and all(
                    isinstance(word, list) and word and all(map(_is_token_id, word))
                    for word in self.bad_words_token_ids
                )
            ),
            "bad_words_token_ids",
            "None or a list of non-empty lists of token ids",
        )
        self._check(
            self.extra_args is None or isinstance(self.extra_args, dict),
            "extra_args",
            "None or a dict",
        )

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

    @property
    def has_penalties(self) -> bool:
        """Whether any of the presence, frequency or repetition penalties is on."""
        return bool(
            self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
        )

    def for_sample(self, index: int) -> SamplingParams:
        """The params of sample ``index`` of ``n``: one sample, and a seed of its own."""
        seed = None if self.seed is None else self.seed + index
        return dataclasses.replace(self, n=1, seed=seed)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_token_id(value: object) -> bool:
    return _is_int(value) and value >= 0


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


#: Every SamplingParams field, in declaration order (the keys a request may set).
SAMPLING_PARAM_NAMES: tuple[str, ...] = tuple(f.name for f in fields(SamplingParams))
