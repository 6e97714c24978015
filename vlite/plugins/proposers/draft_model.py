"""The ``draft_model`` proposer: a second, smaller model sharing the target's vocabulary
drafts each request's next tokens greedily, inside the workers (see
:mod:`vlite.worker.draft_model`); ``speculative_config.model`` names it."""

from __future__ import annotations

from vlite.core.hookspecs import hookimpl
from vlite.core.proposer import DRAFT_MODEL, WorkerProposer


class DraftModelProposer(WorkerProposer):
    """Hands on the drafts the workers' draft model made in each step."""


@hookimpl
def register_proposers(register):
    register(DRAFT_MODEL, DraftModelProposer)
