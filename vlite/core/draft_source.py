"""Asking the proposer for drafts after each step (speculative decoding).

:class:`DraftSource` picks the running requests that may speculate, asks the proposer
plugin, checks its answers and leaves each request's drafts in ``Request.spec_token_ids``
for the scheduler's next step. A request speculates when it is decoding (everything but its
last token computed) and every edit of its logits follows the drafts before a row
(``Request.can_speculate``, see :func:`~vlite.core.proposer.may_speculate`): each of its
rows is then sampled exactly as it would be as the request's next token (penalties and
logits processors read the drafts before the row, logprobs are taken per row), so the
drafts the samples agree with are the model's own tokens.

How many of a proposal's drafts a request verifies is the :class:`DraftBudget`'s call (the
count that yields the most tokens a second, from measured step costs and the request's
measured acceptance). A proposer that drafts in the workers (a draft model) costs a
forward per draft whether or not they are verified, so the :class:`SpeculationGovernor`
pauses it instead, while its steps measure slower than steps without drafts.
"""

from __future__ import annotations

from dataclasses import dataclass

from vlite.core.draft_budget import DraftBudget
from vlite.core.errors import PluginError
from vlite.core.grammar_gate import drafts_the_grammar_accepts
from vlite.core.outputs import EngineCoreOutputs
from vlite.core.proposer import (
    DraftRequest,
    Proposer,
    SpeculativeConfig,
    WorkerProposer,
)
from vlite.core.request import Request, RequestStatus
from vlite.core.scheduler import Scheduler
from vlite.core.speculation_governor import SpeculationGovernor


@dataclass(frozen=True)
class StepTiming:
    """How a finished step went: its wall time, whether it verified drafts, whether it
    computed decode tokens only (no prompt tokens), whether the workers drafted in it
    (a :class:`WorkerProposer`'s drafts), and how many decode tokens (drafts included) it
    computed."""

    seconds: float
    had_drafts: bool
    is_decode_only: bool
    made_drafts: bool = False
    num_decode_tokens: int = 0


class DraftSource:
    """The proposer of one engine, asked after every step.

    Args:
        proposer: the ``speculative_config.method`` plugin's instance.
        config: the speculative-decoding settings.
        scheduler: whose running requests get drafts.
    """

    def __init__(self, proposer: Proposer, config: SpeculativeConfig, scheduler: Scheduler) -> None:
        self.proposer = proposer
        self.config = config
        self.scheduler = scheduler
        #: Trims proposals made here to the drafts that pay.
        self.budget = DraftBudget()
        #: Pauses a worker proposer while drafting measures slower than decoding without.
        self.governor = SpeculationGovernor()
        self._known: set[str] = set()

    def propose(
        self,
        outputs: EngineCoreOutputs,
        step: StepTiming | None = None,
        worker_drafts: dict[str, list[int]] | None = None,
        verified: dict[str, list[int]] | None = None,
    ) -> None:
        """Give the running requests that may speculate their next drafts. ``step``: how
        the step just finished went (its time feeds the :class:`DraftBudget` or the
        :class:`SpeculationGovernor`); ``worker_drafts``: the drafts the workers made in it
        (a :class:`WorkerProposer`'s); ``verified``: the drafts it verified, per request.
        A :class:`WorkerProposer`'s requests are also told how many drafts the workers make
        for them in the next step (``Request.num_worker_drafts``)."""
        self._forget_ended()
        in_worker = isinstance(self.proposer, WorkerProposer)
        if step is not None and step.is_decode_only:
            if not in_worker:
                self.budget.observe_step(step.num_decode_tokens, step.seconds)
            # A worker proposer's steps either verify and draft, or neither; the step on
            # either side of a pause does one of the two, and is like neither kind.
            elif step.had_drafts == step.made_drafts:
                num_tokens = sum(len(output.new_token_ids) for output in outputs.outputs)
                self.governor.record(step.seconds, num_tokens, step.had_drafts)
        if not in_worker:
            self.budget.observe_outputs(verified or {}, outputs.outputs)
        running = self.scheduler.running
        if in_worker:
            self.proposer.receive(worker_drafts or {})
            for request in running:
                request.num_worker_drafts = 0
        disable_at = self.config.disable_by_batch_size
        if disable_at is not None and len(running) >= disable_at:
            return
        if in_worker and not self.governor.allows_drafts():
            return
        asks = {}
        for request in running:
            ask = self._draft_request(request)
            if ask is not None:
                asks[request.request_id] = (request, ask)
        if not asks:
            return
        answers = self._checked(self.proposer.propose([ask for _, ask in asks.values()]), asks)
        if not in_worker:
            answers = self.budget.choose(answers, len(running))
        for request_id, drafts in answers.items():
            request = asks[request_id][0]
            if request.structured_output is not None and drafts:
                drafts = drafts_the_grammar_accepts(request, drafts)
            request.spec_token_ids = drafts
        if in_worker:
            for request, _ in asks.values():
                request.num_worker_drafts = self.config.num_speculative_tokens
        self._known.update(asks)

    def _draft_request(self, request: Request) -> DraftRequest | None:
        if request.status is not RequestStatus.RUNNING or not request.can_speculate:
            return None
        if request.num_computed_tokens != request.num_tokens - 1:
            return None  # its prompt is still being computed
        if self.scheduler.in_flight.get(request.request_id):
            return None  # a batch in flight samples its next token (async scheduling)
        limit = self.scheduler.limits.max_model_len
        max_drafts = min(
            self.config.num_speculative_tokens,
            request.max_tokens - request.num_output_tokens - 1,
            limit - request.num_tokens - 1,
        )
        if max_drafts < 1:
            return None
        return DraftRequest(
            request.request_id, request.all_token_ids, request.num_prompt_tokens, max_drafts
        )

    def _checked(
        self, answers: object, asks: dict[str, tuple[Request, DraftRequest]]
    ) -> dict[str, list[int]]:
        name = type(self.proposer).__qualname__
        if not isinstance(answers, dict):
            raise PluginError(
                f"proposer {name}.propose returned {type(answers).__name__}, not a dict"
            )
        for request_id, drafts in answers.items():
            if request_id not in asks:
                raise PluginError(f"proposer {name} drafted for {request_id!r}, not asked for")
            max_drafts = asks[request_id][1].max_drafts
            if (
                not isinstance(drafts, list)
                or len(drafts) > max_drafts
                or not all(type(token) is int and token >= 0 for token in drafts)
            ):
                raise PluginError(
                    f"proposer {name} drafted {drafts!r} for {request_id!r} (allowed: a list "
                    f"of at most {max_drafts} int token ids)"
                )
        return answers

    def _forget_ended(self) -> None:
        ended = [
            request_id for request_id in self._known if request_id not in self.scheduler.requests
        ]
        if ended:
            self._known.difference_update(ended)
            self.proposer.finish_requests(ended)
            self.budget.forget(ended)
