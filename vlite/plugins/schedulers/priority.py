"""``priority``: the most urgent request first (lower ``priority`` value), ties by arrival."""

from __future__ import annotations

from vlite.core.hookspecs import hookimpl
from vlite.core.request import Request
from vlite.core.scheduling_policy import SchedulingPolicy


def urgency(request: Request) -> tuple[int, int]:
    """Smaller is more urgent: ``(priority, arrival_index)``."""
    return (request.priority, request.arrival_index)


class PriorityPolicy(SchedulingPolicy):
    """Admit by ``(priority, arrival)``; preempt the least urgent running request.

    When blocks run out, the running request with the largest ``(priority, arrival)`` is
    preempted (possibly the one asking for blocks). A waiting request that cannot get
    blocks preempts the least urgent running request that is less urgent than itself;
    if none is, it waits.
    """

    def waiting_sort_key(self, request: Request) -> tuple:
        return urgency(request)

    def choose_victim(self, running: list[Request]) -> Request:
        return max(running, key=urgency)

    def should_preempt_for(self, request: Request, running: list[Request]) -> Request | None:
        less_urgent = [r for r in running if urgency(r) > urgency(request)]
        return max(less_urgent, key=urgency) if less_urgent else None


@hookimpl
def register_schedulers(register):
    register("priority", PriorityPolicy)
