"""``chunked-prefill``: split prompts under the token budget; decodes first (Sarathi-style)."""

from __future__ import annotations

from vlite.core.hookspecs import hookimpl
from vlite.core.request import Request
from vlite.plugins.schedulers.fcfs import FcfsScheduler


class ChunkedPrefillScheduler(FcfsScheduler):
    """FCFS admission and preemption, with prompts computed in chunks.

    Each step, running requests that are decoding take their one token first; running
    requests part-way through their prompt take the next chunk from what is left of the
    budget, then waiting requests are admitted with a first chunk. So a long prompt never
    stalls the decodes: a step mixes them, and prompts longer than the budget work.
    """

    supports_chunked_prefill = True

    def num_tokens_to_schedule(self, request: Request, num_pending: int, budget: int) -> int:
        return min(num_pending, budget)

    def running_order(self, running: list[Request]) -> list[Request]:
        # Stable: decodes (prompt fully computed) in admission order, then prefills.
        return sorted(running, key=lambda r: r.num_computed_tokens < r.num_prompt_tokens)


@hookimpl
def register_schedulers(register):
    register("chunked-prefill", ChunkedPrefillScheduler)
