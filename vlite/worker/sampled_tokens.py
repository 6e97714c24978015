"""A step's sampled tokens, left on the device until the engine asks for them.

With async scheduling the engine submits the next batch before it reads this one's tokens
(``Executor.execute_model_async``). :class:`SampledTokens` lets the worker do the same on one
thread: the sampled ids stay in a device tensor, their copy to the host starts at once (on
CUDA: into pinned memory, non-blocking, with an event), and the next step's forward reads a
request's pending token from that tensor (``CachedRequestState.pending_token``), so the
device never waits for the host in between. :meth:`SampledTokens.result` waits for the copy
only, then appends the tokens to the requests' states.

Results resolve in sampling order: a batch's result first resolves every batch sampled
before it (a request's tokens are appended in order).
"""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future

import torch

from vlite.core.outputs import ModelRunnerOutput
from vlite.worker.input_batch import CachedRequestState
from vlite.worker.logprobs import LogprobsRequest


class SampledTokens(Future):
    """The tokens ``sampled`` ``[n]`` of ``states`` (one per sampled row), as a future of
    the step's :class:`ModelRunnerOutput`.

    Args:
        request_ids: the request of each row.
        states: their states; each gets ``pending_token`` until resolved.
        sampled: ``[n]`` int64 token ids, on the model's device.
        unresolved: the runner's queue of samples not yet resolved; this one is appended.
        logprobs: the rows' logprobs to gather, if any asked for them.
    """

    def __init__(
        self,
        request_ids: list[str],
        states: list[CachedRequestState],
        sampled: torch.Tensor,
        unresolved: deque[SampledTokens],
        logprobs: LogprobsRequest | None = None,
    ) -> None:
        super().__init__()
        self.request_ids = request_ids
        self.states = states
        self.sampled = sampled
        self.logprobs = logprobs
        self._unresolved = unresolved
        self._event: torch.cuda.Event | None = None
        if sampled.is_cuda:
            self._host = torch.empty(sampled.shape, dtype=sampled.dtype, pin_memory=True)
            self._host.copy_(sampled, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = sampled
        for row, state in enumerate(states):
            state.pending_token = (sampled, row)
        unresolved.append(self)

    def result(self, timeout: float | None = None) -> ModelRunnerOutput:
        """The step's output: waits for this batch's tokens (and resolves earlier batches)."""
        while self._unresolved and not self.done():
            self._unresolved.popleft()._resolve()
        return super().result(timeout)

    @torch.inference_mode()
    def _resolve(self) -> None:
        if self._event is not None:
            self._event.synchronize()
        token_ids = self._host.tolist()
        for state, token_id in zip(self.states, token_ids):
            state.token_ids.append(token_id)
            if state.pending_token is not None and state.pending_token[0] is self.sampled:
                state.pending_token = None  # (a later batch's pending token stays)
        output = ModelRunnerOutput(
            sampled_token_ids={rid: [tid] for rid, tid in zip(self.request_ids, token_ids)}
        )
        if self.logprobs is not None:
            entries = self.logprobs.gather(self.sampled)
            output.logprobs = {
                self.request_ids[row]: [entry] for row, entry in zip(self.logprobs.rows, entries)
            }
        self.set_result(output)


def resolve_all(unresolved: deque[SampledTokens]) -> None:
    """Resolve every sample in ``unresolved`` (before a step reads its requests' tokens)."""
    while unresolved:
        unresolved.popleft()._resolve()
