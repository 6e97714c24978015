"""The logits-processor interface (``register_logits_processors``): batch-level edits of a
step's logits before the sampler plugin runs.

vLLM V1's shape: a processor keeps per-request state, updated from the batch's changes
(:meth:`LogitsProcessor.update_state`), and edits the whole batch's logits at once
(:meth:`LogitsProcessor.apply`). vlite's model runner keeps no persistent batch whose slots
move, so a :class:`BatchUpdate` names requests by id and gives the step's row order
outright, instead of vLLM's added/removed/moved slot indices: a processor keyed by request
id never has to replay slot moves.

Every registered processor runs in every worker that samples, in registration order, each
step: ``update_state`` then ``apply``. A processor decides from a request's
``SamplingParams`` whether it applies to it (the built-ins read ``logit_bias``,
``allowed_token_ids``, ``bad_words_token_ids`` and ``min_tokens``; a third-party processor
reads its own key in ``extra_args``, which is how a request selects it).

The per-step cost contract:

- ``update_state`` costs O(changes + rows) host work and never synchronizes with the
  device; a processor that applies to no request returns at once.
- ``apply`` on a batch in which it applies to no row returns ``logits`` untouched, without
  launching device work (so requests that use no processor pay nothing measurable); else it
  may edit ``logits`` in place and returns them, with no device-to-host copy.
- The result for a row depends only on that row's logits and request (batch invariance:
  the same request gets the same edit whatever else is in the batch, in whatever order),
  and, for a row that follows draft tokens (speculative decoding), those drafts.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from vlite.core.sampling_params import SamplingParams


@dataclass(frozen=True)
class AddedRequest:
    """A request the worker sees for the first time.

    Attributes:
        request_id: its id.
        params: its sampling parameters.
        token_ids: its tokens, prompt first, then its output: a live list that the model
            runner extends as tokens are sampled (read it, never change it).
        num_prompt_tokens: how many of ``token_ids`` are the prompt.
        eos_token_id: the tokenizer's end-of-sequence token (``None``: it has none), which
            ends the request unless ``params.ignore_eos``.
    """

    request_id: str
    params: SamplingParams
    token_ids: list[int]
    num_prompt_tokens: int
    eos_token_id: int | None = None

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


@dataclass(frozen=True)
class BatchUpdate:
    """What changed since the previous step, and this step's rows.

    Apply ``removed`` before ``added``: an id in both is a request that finished and a new
    one that took its id. An id appears at most once in ``added``; ``removed`` may name
    requests the processor never saw (ignore those).

    Attributes:
        added: requests seen for the first time since the previous call.
        removed: ids of requests that finished (or were aborted) since the previous call.
        rows: ``rows[i]`` is the request whose logits are row ``i`` of this step's
            ``apply`` (only the requests that sample this step, in the batch's order). A
            request verifying ``k`` draft tokens has ``k + 1`` consecutive rows.
        drafts_before: empty when no row follows drafts; else one list per row: the draft
            tokens between the request's ``token_ids`` and that row (the ``i``-th row of a
            request verifying drafts ``d`` follows ``d[:i]``: its edit is the one the
            request would get with ``d[:i]`` appended to its tokens).
    """

    added: list[AddedRequest] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    rows: list[str] = field(default_factory=list)
    drafts_before: list[list[int]] = field(default_factory=list)

    def drafts_before_row(self, row: int) -> list[int]:
        """The drafts row ``row`` follows (``[]`` for none)."""
        return self.drafts_before[row] if self.drafts_before else []


class LogitsProcessor(ABC):
    """A batch-level logits edit; see the module docstring for the contract.

    Args:
        config: the engine configuration (:class:`~vlite.core.config.VliteConfig`).
        device: where the logits live.
        vocab_size: the width of the logits.

    Attributes:
        follows_drafts: whether every row that follows draft tokens gets the edit its
            request would get with those drafts appended (:attr:`BatchUpdate.drafts_before`;
            an edit that does not depend on the tokens before a row needs nothing more).
            ``LogitsProcessorConformance`` checks a processor that claims it. Requests with
            ``extra_args`` (how a request selects a third-party processor) speculate only
            when every registered processor claims it; the built-ins do.
    """

    follows_drafts: ClassVar[bool] = False

    def __init__(self, config: Any, device: torch.device, vocab_size: int) -> None:
        self.config = config
        self.device = device
        self.vocab_size = vocab_size

    @abstractmethod
    def update_state(self, batch_update: BatchUpdate) -> None:
        """Learn the batch's changes and this step's rows (called every step, first)."""

    @abstractmethod
    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Edit ``logits`` (``[len(rows), vocab_size]`` float32, rows as in the last
        :class:`BatchUpdate`) and return them (in place allowed)."""

    def is_argmax_invariant(self) -> bool:
        """Whether :meth:`apply` never changes a row's argmax (then a greedy row could skip
        it). Default ``False``: every built-in can change the argmax."""
        return False
