"""The front end's checks of a request's output controls, before it reaches the engine core.

- Token ids in ``logit_bias``, ``allowed_token_ids`` and ``bad_words_token_ids`` must be in
  the model's vocabulary.
- ``bad_words`` are tokenized into ``bad_words_token_ids`` (each word with and without a
  leading space, as it can appear mid-sentence or at the start).
- ``structured_outputs`` is validated by its backend's tokenizer-free ``validate``, so a
  bad schema, regex or grammar is an :class:`InvalidRequestError` (an HTTP 400) here,
  instead of a request that fails later in the core. Successes are remembered (the same
  schema is usually sent again and again).
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from vlite.core.errors import InvalidRequestError
from vlite.core.plugins import PluginRegistry
from vlite.core.sampling_params import SamplingParams
from vlite.core.structured_output import check_backend_takes
from vlite.core.structured_output_params import StructuredOutputsError, StructuredOutputsParams

#: Validated constraints remembered per front end.
VALIDATED_CACHE_SIZE = 1024
BACKEND_KIND = "structured_output_backend"


class StructuredOutputValidator:
    """Checks constraints with their backend's ``validate`` (no tokenizer, no engine).

    Args:
        default_backend: the engine's ``structured_outputs_backend``.
        registry: the plugin registry, or a function that builds it (called on first use,
            so a front end that never sees a constraint loads no plugins for it).
    """

    def __init__(
        self, default_backend: str, registry: PluginRegistry | Callable[[], PluginRegistry]
    ) -> None:
        self.default_backend = default_backend
        self._registry = registry
        self._validated: OrderedDict[tuple[str, str, str], None] = OrderedDict()

    def _backend_cls(self, name: str) -> type:
        if not isinstance(self._registry, PluginRegistry):
            self._registry = self._registry()
        try:
            return self._registry.get(BACKEND_KIND, name)
        except ValueError as exc:
            raise StructuredOutputsError(
                f"structured_outputs.backend: {exc}", "structured_outputs.backend"
            ) from None

    def __call__(self, params: StructuredOutputsParams) -> None:
        """Raise :class:`StructuredOutputsError` naming the problem if ``params`` cannot
        compile with its backend."""
        name = params.backend or self.default_backend
        key = (name, *params.key)
        if key in self._validated:
            self._validated.move_to_end(key)
            return
        backend_cls = self._backend_cls(name)
        check_backend_takes(name, backend_cls, params)
        try:
            backend_cls.validate(params)
        except ValueError as exc:
            raise StructuredOutputsError(str(exc), f"structured_outputs.{params.kind}") from None
        self._validated[key] = None
        while len(self._validated) > VALIDATED_CACHE_SIZE:
            self._validated.popitem(last=False)


def prepare_output_controls(
    params: SamplingParams,
    tokenizer: Any,
    vocab_size: int | None,
    validate_structured: Callable[[StructuredOutputsParams], None] | None,
) -> SamplingParams:
    """``params`` checked, with ``bad_words`` tokenized (a new object when anything changes).

    Raises:
        InvalidRequestError: a token id outside the vocabulary (naming the field and the
            id), or a constraint its backend cannot compile.
    """
    if params.bad_words:
        words = _tokenize_bad_words(params.bad_words, tokenizer)
        params = dataclasses.replace(
            params, bad_words_token_ids=[*(params.bad_words_token_ids or []), *words]
        )
    if vocab_size is not None:
        _check_ids_in_vocab(params, vocab_size)
    if params.structured_outputs is not None and validate_structured is not None:
        validate_structured(params.structured_outputs)
    return params


def _tokenize_bad_words(words: list[str], tokenizer: Any) -> list[list[int]]:
    """Each word's token ids at the start of a text and after a space (duplicates once)."""
    sequences: list[list[int]] = []
    for word in words:
        for text in (word.lstrip(), " " + word.lstrip()):
            ids = tokenizer.encode(text, add_special_tokens=False)
            if ids and ids not in sequences:
                sequences.append(ids)
    return sequences


def _check_ids_in_vocab(params: SamplingParams, vocab_size: int) -> None:
    fields = {
        "logit_bias": list(params.logit_bias or ()),
        "allowed_token_ids": params.allowed_token_ids or [],
        "bad_words_token_ids": [t for word in params.bad_words_token_ids or [] for t in word],
    }
    for name, ids in fields.items():
        outside = [token_id for token_id in ids if token_id >= vocab_size]
        if outside:
            raise InvalidRequestError(
                f"SamplingParams.{name} holds token id {outside[0]}, outside the model's "
                f"vocabulary (ids must be < {vocab_size})"
            )
