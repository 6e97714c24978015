"""LeastLoadedRouter: which engine core a new request goes to, under data parallelism.

A core's load is its waiting plus running requests, as the core itself last reported them
(the answer to a :class:`~vlite.engine.core_messages.GetStats`), brought up to date with
what happened since that the answer could not count::

    load = reported
         + requests sent to the core after the question was sent
         - requests the front end ended there after the question was sent (aborts, stops)
         - requests the core reported ended after its answer arrived (finished, failed)

Both directions of a core's connection keep their order (the core handles its inputs one
after another, and sends its outputs in order), which is what makes each cut-off point
exact: an add or an abort sent before the question is in the answer, one sent after is
not; an output that arrives before the answer happened before it. So a burst of arrivals
between two answers still spreads: each one raises the load of the core it went to at once.
Before a core's first answer its load is simply what was sent to it less what ended.

A new request goes to the core with the smallest load; among equals, to the first at or
after a round-robin cursor, which then moves past it, so equal cores take turns.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field


@dataclass
class _Counts:
    """Monotonic counters of one core, as a snapshot can be taken of them."""

    sent: int = 0
    withdrawn: int = 0
    finished: int = 0


@dataclass
class CoreLoad:
    """What the router knows about one core's load."""

    #: Waiting + running in the core's latest answer (0 before the first).
    reported: int = 0
    #: Requests sent to it, ended by the front end, and reported ended by it, ever.
    counts: _Counts = field(default_factory=_Counts)
    #: ``counts`` where the latest answer stands: sent and withdrawn when its question
    #: was sent, finished when it arrived.
    at_report: _Counts = field(default_factory=_Counts)
    #: ``(sent, withdrawn)`` when each question not yet answered was sent, oldest first.
    questions: deque[tuple[int, int]] = field(default_factory=deque)

    @property
    def load(self) -> int:
        counts, base = self.counts, self.at_report
        estimate = (
            self.reported
            + (counts.sent - base.sent)
            - (counts.withdrawn - base.withdrawn)
            - (counts.finished - base.finished)
        )
        return max(0, estimate)


class LeastLoadedRouter:
    """Chooses the least-loaded of ``num_cores`` engine cores (see the module docstring).

    The caller records what it does with :meth:`record_sent`, :meth:`record_withdrawn`,
    :meth:`record_finished`, :meth:`record_question` and :meth:`record_answer`.

    Raises:
        ValueError: ``num_cores`` is less than 1.
    """

    def __init__(self, num_cores: int) -> None:
        if num_cores < 1:
            raise ValueError(f"a router needs at least one engine core, got num_cores={num_cores}")
        self.cores = [CoreLoad() for _ in range(num_cores)]
        self._cursor = 0

    @property
    def loads(self) -> list[int]:
        """Each core's estimated load (waiting + running requests)."""
        return [core.load for core in self.cores]

    def choose(self) -> int:
        """The index of the core the next request should go to."""
        loads = self.loads
        least = min(loads)
        num_cores = len(loads)
        for offset in range(num_cores):
            index = (self._cursor + offset) % num_cores
            if loads[index] == least:
                self._cursor = (index + 1) % num_cores
                return index
        raise AssertionError("unreachable: some core has the least load")

    def record_sent(self, core: int, count: int = 1) -> None:
        """``count`` requests were sent to ``core``."""
        self.cores[core].counts.sent += count

    def record_withdrawn(self, core: int, count: int = 1) -> None:
        """The front end ended ``count`` of ``core``'s requests (aborted, or stopped)."""
        self.cores[core].counts.withdrawn += count

    def record_finished(self, core: int, count: int = 1) -> None:
        """``core`` reported ``count`` of its requests ended (finished, or failed)."""
        self.cores[core].counts.finished += count

    def record_question(self, core: int) -> None:
        """A statistics question was just sent to ``core``."""
        counts = self.cores[core].counts
        self.cores[core].questions.append((counts.sent, counts.withdrawn))

    def is_awaiting_answer(self, core: int) -> bool:
        return bool(self.cores[core].questions)

    def record_answer(self, core: int, num_waiting_and_running: int | None) -> None:
        """``core`` answered its oldest open question (``None``: with an error, which
        leaves the estimate as it was). An answer to no known question is ignored."""
        state = self.cores[core]
        if not state.questions:
            return
        sent, withdrawn = state.questions.popleft()
        if num_waiting_and_running is None:
            return
        state.reported = num_waiting_and_running
        state.at_report = _Counts(sent, withdrawn, state.counts.finished)
