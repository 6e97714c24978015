"""Speculative decoding's proposers: the plugin kind that guesses a request's next tokens.

After each step's ``update_from_output`` the engine asks the configured proposer for up to
``num_speculative_tokens`` draft tokens per running request (:class:`DraftRequest`); the
scheduler computes a request's last token and its drafts in the next step, and the worker
keeps the longest prefix of drafts the target model's own sampling agrees with, plus one
token of its own (see :mod:`vlite.worker.draft_verification`). The output is exactly what the
target model alone would produce: drafts only decide how many tokens one step yields.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field, model_validator

from vlite.core.sampling_params import SamplingParams


class SpeculativeConfig(BaseModel):
    """The ``speculative_config`` setting: which proposer, and how many drafts.

    Attributes:
        method: the proposer plugin's name (built in: ``ngram``, ``suffix``,
            ``draft_model``).
        num_speculative_tokens: the most draft tokens per request and step.
        prompt_lookup_min: ``ngram``, ``suffix``: the shortest suffix of the context matched.
        prompt_lookup_max: ``ngram``, ``suffix``: the longest suffix of the context matched.
        model: ``draft_model``: the draft model (a GGUF file, a Hugging Face folder or Hub
            id, as ``model``), which must share the target's vocabulary.
        disable_by_batch_size: no request gets drafts in a step that starts with at least
            this many running requests (speculation costs compute a large batch can use);
            ``None``: never disabled.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    method: str = "ngram"
    num_speculative_tokens: int = Field(4, ge=1, le=32)
    prompt_lookup_min: int = Field(2, ge=1)
    prompt_lookup_max: int = Field(5, ge=1)
    model: str | None = None
    disable_by_batch_size: int | None = Field(None, ge=1)

    @model_validator(mode="after")
    def _lookup_range(self) -> SpeculativeConfig:
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"prompt_lookup_min={self.prompt_lookup_min} is above prompt_lookup_max="
                f"{self.prompt_lookup_max}; allowed: prompt_lookup_min <= prompt_lookup_max"
            )
        return self

    @model_validator(mode="after")
    def _draft_model(self) -> SpeculativeConfig:
        if self.method == DRAFT_MODEL and self.model is None:
            raise ValueError(
                "method='draft_model' needs model: the draft model's GGUF file, folder or Hub "
                "id (it must share the target's vocabulary)"
            )
        if self.method != DRAFT_MODEL and self.model is not None:
            raise ValueError(
                f"model={self.model!r} is read only by method='draft_model', not "
                f"method={self.method!r}"
            )
        return self


def may_speculate(params: SamplingParams, processors_follow_drafts: bool = False) -> bool:
    """Whether a request with ``params`` samples each row from its context and the drafts
    before that row: its logits; for penalties its tokens with those drafts (the worker
    counts them); for a grammar the mask of the grammar's state after them (one bitmask
    row per position); and every logits processor's edit with them
    (:attr:`~vlite.core.logits_processor.LogitsProcessor.follows_drafts`, which every
    built-in claims). A request with ``extra_args``, which may select a third-party
    processor, speculates only when every registered processor follows drafts
    (``processors_follow_drafts``)."""
    return processors_follow_drafts or not params.extra_args


#: The method whose drafts a second model makes inside the workers.
DRAFT_MODEL = "draft_model"


@dataclass(frozen=True)
class DraftRequest:
    """A running request a proposer may draft for.

    Attributes:
        request_id: the request.
        token_ids: every token it knows, prompt then output (read-only).
        num_prompt_tokens: how many of ``token_ids`` are the prompt.
        max_drafts: the most drafts it may take (``num_speculative_tokens``, less where
            ``max_tokens`` or the context length ends the request sooner); >= 1.
    """

    request_id: str
    token_ids: Sequence[int]
    num_prompt_tokens: int
    max_drafts: int


class Proposer(ABC):
    """Guesses the next tokens of running requests. Registered with ``register_proposers``
    and constructed as ``cls(config)`` (the :class:`SpeculativeConfig`) once per engine, in
    the engine-core process.

    A proposer may keep state across steps (an n-gram table over finished requests, ...);
    :meth:`finish_requests` says which requests have ended.
    """

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config

    @abstractmethod
    def propose(self, requests: Sequence[DraftRequest]) -> dict[str, list[int]]:
        """Draft tokens for some of ``requests``: request id -> at most its ``max_drafts``
        token ids. A request left out (or given ``[]``) gets none this step."""

    def finish_requests(self, request_ids: Sequence[str]) -> None:  # noqa: B027
        """``request_ids`` have ended (finished, aborted or failed). Default: nothing."""


class WorkerProposer(Proposer):
    """A proposer whose drafts the workers make during each step (``draft_model``: a second
    model next to the target, see :mod:`vlite.worker.draft_model`).

    The scheduler allocates the slots of the drafts the workers are asked for
    (``Request.num_worker_drafts``, ``SchedulerOutput.num_lookahead_tokens``); the step's
    output carries them back (``ModelRunnerOutput.draft_token_ids``), and the engine hands
    them to :meth:`receive` before :meth:`propose` picks those of the requests asked.
    """

    def __init__(self, config: SpeculativeConfig) -> None:
        super().__init__(config)
        self._drafts: dict[str, list[int]] = {}

    def receive(self, drafts: dict[str, list[int]]) -> None:
        """The drafts the workers made in the step that just ended."""
        self._drafts = drafts

    def propose(self, requests: Sequence[DraftRequest]) -> dict[str, list[int]]:
        drafts = self._drafts
        return {
            request.request_id: list(drafts[request.request_id][: request.max_drafts])
            for request in requests
            if request.request_id in drafts
        }
