"""``shortest-prompt-first``: admit short prompts first, to cut their time to first token."""

from vlite.core.request import Request
from vlite.core.scheduling_policy import SchedulingPolicy


class ShortestPromptFirstPolicy(SchedulingPolicy):
    """Admit the waiting request with the shortest prompt (ties by arrival); when blocks
    run out, preempt the running request that would be admitted last.

    Only the policy lives here; vlite's scheduler supplies the mechanism (token budget,
    block allocation, chunked prefill, preemption, bookkeeping) and asks this object two
    questions. Long prompts can wait behind a stream of short ones: this policy trades
    fairness for latency.
    """

    def waiting_sort_key(self, request: Request) -> tuple:
        return (request.num_prompt_tokens, request.arrival_index)

    def choose_victim(self, running: list[Request]) -> Request:
        return max(running, key=self.waiting_sort_key)
