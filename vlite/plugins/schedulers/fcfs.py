"""``fcfs``: first come, first served."""

from __future__ import annotations

from vlite.core.hookspecs import hookimpl
from vlite.core.request import Request
from vlite.core.scheduling_policy import SchedulingPolicy


class FcfsPolicy(SchedulingPolicy):
    """Admit in arrival order; when blocks run out, preempt the latest-admitted request.

    A preempted request arrived before every request still waiting (admission is in
    arrival order), so sorting by arrival puts it back at the head of the queue.
    """

    def waiting_sort_key(self, request: Request) -> tuple:
        return (request.arrival_index,)

    def choose_victim(self, running: list[Request]) -> Request:
        return running[-1]


@hookimpl
def register_schedulers(register):
    register("fcfs", FcfsPolicy)
