"""``chunked-prefill``: the ``fcfs`` policy with chunked prefill on by default."""

from __future__ import annotations

from vlite.core.hookspecs import hookimpl
from vlite.plugins.schedulers.fcfs import FcfsPolicy


class ChunkedPrefillPolicy(FcfsPolicy):
    """FCFS admission and preemption; prompts are computed in chunks unless the config
    turns chunking off.

    The same as ``--scheduler fcfs --enable-chunked-prefill``: each step, decoding requests
    take their one token first, requests part-way through their prompt take the next chunk
    from what is left of the budget, then waiting requests are admitted with a first chunk.
    A long prompt never stalls the decodes, and prompts longer than the budget work.
    """

    default_enable_chunked_prefill = True


@hookimpl
def register_schedulers(register):
    register("chunked-prefill", ChunkedPrefillPolicy)
