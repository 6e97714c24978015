"""How a Ray error from a rank's actor becomes an error naming the rank and its node.

A rank fails in one of two ways: its code raised (Ray hands back a ``RayTaskError`` that
carries the exception and the actor's traceback), or its actor is gone or unreachable (a
``RayActorError``: the process died or was killed, or its node left the cluster). Ranks
whose actor is gone are named first: a rank that lost a peer fails in its next collective,
and the peer's death is the cause worth reading. Ranks that had not replied when the error
was raised are named last, with their node: Ray may not have noticed yet that a node
vanished (it takes its health checks a few seconds), while its peers already failed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from vlite.core.errors import ExecutorFailedError


class RayWorkerError(ExecutorFailedError):
    """A rank's Ray actor raised, died, or became unreachable; the executor runs no more
    steps."""


@dataclass(frozen=True)
class RankFailure:
    """What went wrong on one rank.

    Attributes:
        rank: the global rank.
        where: the actor's process and node (see ``RankLocation.describe``).
        cause: what happened, readable.
        actor_is_gone: the actor died or cannot be reached (rather than raised).
        error: the Ray exception; ``None`` for a rank that had not replied yet.
    """

    rank: int
    where: str
    cause: str
    actor_is_gone: bool
    error: BaseException | None

    @property
    def is_silent(self) -> bool:
        return self.error is None

    def describe(self) -> str:
        verb = "" if self.is_silent else "failed: "
        return f"worker rank {self.rank} ({self.where}) {verb}{self.cause}"


def silent_rank(rank: int, where: str, waited_s: float) -> RankFailure:
    """A rank that had not replied ``waited_s`` after another rank failed."""
    return RankFailure(rank, where, f"had not replied {waited_s:g} s later", False, None)


def rank_failure(rank: int, where: str, error: BaseException) -> RankFailure:
    """Classify and describe the exception a rank's remote call ended with."""
    from ray.exceptions import RayActorError, RayTaskError

    if isinstance(error, RayTaskError):
        cause = error.cause
        text = f"{type(cause).__name__}: {cause}\n--- worker traceback ---\n{_traceback(error)}"
        return RankFailure(rank, where, text, False, error)
    if isinstance(error, RayActorError):
        return RankFailure(rank, where, f"its Ray actor is gone: {_reason(error)}", True, error)
    return RankFailure(rank, where, f"{type(error).__name__}: {error}", False, error)


def _traceback(error: BaseException) -> str:
    """The actor's traceback, as Ray formats a task error (its terminal colours removed)."""
    return re.sub(r"\x1b\[[0-9;]*m", "", str(error)).rstrip()


def _reason(error: BaseException) -> str:
    """The line of a ``RayActorError`` that says why (Ray's advice paragraphs left out)."""
    text = getattr(error, "error_msg", None) or str(error)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    why = next((line for line in lines if "because" in line or "unavailable" in line), None)
    if why is None:
        return lines[0] if lines else type(error).__name__
    return why.split(" Some common causes")[0]


def combined_error(failures: list[RankFailure]) -> RayWorkerError:
    """One error for every failed rank: ranks whose actor is gone first, silent ones last."""
    ordered = sorted(failures, key=lambda f: (not f.actor_is_gone, f.is_silent))
    return RayWorkerError("; ".join(failure.describe() for failure in ordered))
