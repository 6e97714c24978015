"""SchedulingPolicy: the questions a scheduler plugin answers; the mechanism asks them.

The core's :class:`~vlite.core.scheduler.Scheduler` is the *mechanism* (queues, token
budget, ``max_num_seqs``, KV blocks and prefix-cache lookups, chunked prefill, recompute
preemption, stop checks). A scheduler plugin registers a :class:`SchedulingPolicy` subclass,
which the mechanism constructs with no arguments and asks, each step:

* :meth:`~SchedulingPolicy.waiting_sort_key` — in which order are waiting requests admitted?
* :meth:`~SchedulingPolicy.choose_victim` — which running request is preempted when a step
  runs out of blocks?

and, optionally (the defaults keep admission order, never preempt for an arrival and leave
chunk sizes to the mechanism):

* :meth:`~SchedulingPolicy.running_order` — in which order do running requests claim the
  step's token budget?
* :meth:`~SchedulingPolicy.should_preempt_for` — may a waiting request that cannot get
  blocks take them from a running one?
* :meth:`~SchedulingPolicy.max_chunk_tokens` — the largest prompt chunk of a request.

Because chunking, preemption and prefix caching belong to the mechanism, every policy works
with each of them: ``--scheduler priority --enable-chunked-prefill`` orders by priority
*and* chunks prompts.

What a policy may read of a :class:`~vlite.core.request.Request`: ``request_id``,
``priority`` (lower is more urgent), ``arrival_index`` (0, 1, 2, ... in the order the core
received requests; ties in every built-in policy go by it), ``arrival_time``,
``num_prompt_tokens``, ``num_tokens`` (prompt plus generated), ``num_computed_tokens``
(tokens whose K/V are cached; a request is *prefilling* while it is below
``num_prompt_tokens``), ``num_output_tokens``, ``max_tokens``, ``num_preemptions`` and
``sampling_params``. A policy must not change a request.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from vlite.core.request import Request


class SchedulingPolicy(ABC):
    """Base class of scheduler plugins (``register_schedulers``); see the module docstring.

    The mechanism checks every answer: a victim that is not running, a running order that
    is not a reordering of ``running``, or a chunk limit below 1 is a
    :class:`~vlite.core.errors.PluginError` naming the policy.
    """

    #: Whether the engine chunks prompts with this policy when the config leaves
    #: ``enable_chunked_prefill`` unset (the ``chunked-prefill`` policy sets it).
    default_enable_chunked_prefill: bool = False

    @abstractmethod
    def waiting_sort_key(self, request: Request) -> tuple:
        """Sort key of a waiting request: the smallest is admitted first.

        The waiting queue is kept sorted as requests arrive, so the key of a request must
        not change while it waits. Preempted requests re-enter the queue by the same key.
        """

    @abstractmethod
    def choose_victim(self, running: list[Request]) -> Request:
        """The running request to preempt when a step runs out of KV blocks.

        ``running`` is every running request in admission order (a request re-admitted
        after preemption counts as admitted then); the victim may be the request that is
        asking for blocks. Its blocks are freed and it waits, to be recomputed later.
        """

    def running_order(self, running: list[Request]) -> list[Request]:
        """The order in which running requests claim this step's token budget.

        Returns a new list holding exactly the requests of ``running`` (admission order);
        the default keeps it. With chunked prefill the mechanism then moves decoding
        requests ahead of prefilling ones (keeping this order within each group), so a
        long prompt never stalls the running streams.
        """
        return list(running)

    def should_preempt_for(self, request: Request, running: list[Request]) -> Request | None:
        """The running request to preempt so that waiting ``request`` can be admitted.

        Called when ``request``, next in the waiting queue, cannot get its KV blocks and no
        preemption happened earlier in the step. ``running`` holds the candidates: running
        requests not admitted in this step, less those already named for this admission.
        The mechanism asks again (without the named request) until the named requests
        would free enough blocks, then preempts them all; ``None`` (the default) ends the
        asking. If the named requests would not free enough, none is preempted and
        ``request`` waits for blocks to free up.
        """
        return None

    def max_chunk_tokens(self, request: Request) -> int | None:
        """The most pending tokens ``request`` may compute in one step when prompts are
        chunked; ``None`` (the default): the engine's ``long_prefill_token_threshold``
        (or, when that is 0, whatever the token budget leaves).

        Not called when chunked prefill is off (a prompt then runs whole or waits).
        """
        return None
