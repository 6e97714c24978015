"""``shortest-prompt-first``: admit short prompts first, to cut their time to first token."""

from vlite.core.request import Request
from vlite.core.scheduler import Scheduler


class ShortestPromptFirstScheduler(Scheduler):
    """Admit the waiting request with the shortest prompt (ties by arrival); when blocks
    run out, preempt the running request that would be admitted last.

    Only the policy lives here; vlite's :class:`~vlite.core.scheduler.Scheduler` supplies
    the mechanism (token budget, block allocation, preemption, bookkeeping). Long prompts
    can wait behind a stream of short ones: this policy trades fairness for latency.
    """

    supports_chunked_prefill = False  # whole prompts only (the base class's default)

    def waiting_sort_key(self, request: Request) -> tuple:
        return (request.num_prompt_tokens, self.arrival_index(request))

    def choose_victim(self, running: list[Request]) -> Request:
        return max(running, key=self.waiting_sort_key)
