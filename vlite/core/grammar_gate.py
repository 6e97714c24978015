"""GrammarGate: structured-output requests held until their grammar compiles, then steered.

A request with ``sampling_params.structured_outputs`` cannot be scheduled before its grammar
exists (its first sampled token needs the grammar's mask). The scheduler hands such a
request to the gate on arrival; the gate starts the compile (on the
:class:`~vlite.core.structured_output_manager.StructuredOutputManager`'s threads) and
holds the request as ``WAITING_FOR_FSM``. Before each step the scheduler asks
:meth:`GrammarGate.release` for the requests whose grammar is ready (they join the waiting
queue) and those whose grammar failed or took too long (they end, with the reason). While
the request runs, the gate builds each step's token masks (:meth:`GrammarGate.bitmask`) and
advances its grammar by each sampled token (:func:`grammar_ends`).
"""

from __future__ import annotations

from vlite.core.outputs import GrammarBitmask
from vlite.core.request import Request, RequestStatus
from vlite.core.structured_output_manager import StructuredOutputManager, StructuredOutputRequest


class GrammarGate:
    """The structured-output side of one scheduler (see the module docstring).

    Attributes:
        manager: compiles and queries grammars (needed once a request with structured
            outputs arrives).
        compiling: requests whose grammar is compiling (``WAITING_FOR_FSM``), in arrival
            order.
        num_structured: requests held by the scheduler that have a grammar (compiling,
            waiting or running): while it is 0 no step needs a bitmask.
    """

    def __init__(self, manager: StructuredOutputManager | None = None) -> None:
        self.manager = manager
        self.compiling: list[Request] = []
        self.num_structured = 0

    def hold(self, request: Request) -> None:
        """Start compiling ``request``'s grammar and hold it until :meth:`release`."""
        if self.manager is None:
            raise RuntimeError("the scheduler has no StructuredOutputManager (set by the engine)")
        request.structured_output = self.manager.start(request.sampling_params.structured_outputs)
        request.status = RequestStatus.WAITING_FOR_FSM
        self.compiling.append(request)
        self.num_structured += 1

    def release(self) -> tuple[list[Request], list[tuple[Request, str]]]:
        """``(ready, failed)``: the requests whose grammar compiled (now ``WAITING``, with
        their matcher), and those whose grammar failed or passed the compile timeout (now
        ``FINISHED_ERROR``), each with why. The rest stay held."""
        if not self.compiling:
            return [], []
        ready: list[Request] = []
        failed: list[tuple[Request, str]] = []
        still_compiling = []
        timeout_s = self.manager.compile_timeout_s
        for request in self.compiling:
            grammar = request.structured_output
            if grammar.give_up_after(timeout_s):
                failed.append((request, grammar.error))
            elif not grammar.is_compiled:
                still_compiling.append(request)
            elif grammar.start_matching():
                request.status = RequestStatus.WAITING
                ready.append(request)
            else:
                failed.append((request, grammar.error))
        for request, _ in failed:
            request.status = RequestStatus.FINISHED_ERROR
        self.compiling = still_compiling
        return ready, failed

    def drop(self, request: Request) -> None:
        """Stop holding a request that ends while its grammar compiles (an abort)."""
        self.compiling.remove(request)

    def forget(self, request: Request) -> None:
        """``request`` has left the scheduler (finished, failed or aborted)."""
        if request.structured_output is not None:
            self.num_structured -= 1

    def bitmask(
        self,
        rows: list[tuple[str, StructuredOutputRequest]],
        drafts: dict[str, list[int]] | None = None,
    ) -> GrammarBitmask | None:
        """The step's masks: one row per ``(request id, grammar)`` that samples this step,
        and one more per draft it verifies."""
        return self.manager.grammar_bitmask(rows, drafts)


def drafts_the_grammar_accepts(request: Request, drafts: list[int]) -> list[int]:
    """The longest prefix of ``drafts`` the request's grammar accepts after its tokens (a
    draft it refuses could never be sampled, nor any after it); the grammar is left as it
    was."""
    matcher = request.structured_output.matcher
    kept = 0
    for token in drafts:
        if not matcher.accept_token(token):
            break
        kept += 1
    matcher.rollback(kept)
    return drafts[:kept]


def grammar_ends(request: Request, token_id: int) -> bool:
    """Advance the request's grammar by ``token_id``; finish the request (and say so) when
    the grammar is complete (``stop``) or forbids the token (``error``: the sampler did
    not honour the mask)."""
    matcher = request.structured_output.matcher
    if not matcher.accept_token(token_id):
        request.status = RequestStatus.FINISHED_ERROR
        request.error = (
            f"token {token_id} was sampled, but the request's grammar does not allow it "
            "there (the sampler did not honour the grammar's mask)"
        )
        return True
    if matcher.is_terminated():
        request.status = RequestStatus.FINISHED_STOPPED
        params = request.sampling_params
        request.shows_last_token = (
            token_id != request.eos_token_id and token_id not in params.stop_token_ids
        )
        return True
    return False
