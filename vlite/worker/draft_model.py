"""Speculative decoding's draft model (``speculative_config.method="draft_model"``): a
second, smaller model in the same worker proposes each request's next tokens.

Its KV cache is its own tensors, laid out like the target's: as many blocks, and each
request's block table is the target's, so the scheduler's allocation, prefix caching,
preemption and the release of rejected drafts' blocks govern both caches. In every step,
after the target samples, the draft computes

1. what it has not yet computed of the known tokens of each scheduled request that is in
   its prompt or drafts this step: the prompt chunk the target computed (so a prompt is
   chunked alike for both), the tokens of steps it sat out, the accepted drafts it did not
   write itself, and for a request that drafts, the token the step sampled. A decoding
   request that does not draft (speculation paused, or not for it) costs the draft nothing;
2. for each request that drafts (``SchedulerOutput.num_lookahead_tokens``), its drafts one
   forward at a time, each the argmax of the draft's logits (greedy: the drafts carry no
   distribution, and verification keeps exactly the target's, see
   :mod:`vlite.worker.draft_verification`). Each draft but the last is written to the cache,
   into the lookahead slots the scheduler allocated after the request's scheduled ones.

The draft remembers, per request, how many positions of its cache hold the request's
tokens (``valid``) and which drafts it wrote after them; the next step keeps those the target
accepted. A request whose blocks were given back (rejected drafts'), or that was preempted,
counts only the positions its kept blocks hold. Per block, it remembers whether it filled
the block for the tokens the target's block holds: a prefix hit counts for the draft as far
as its blocks are filled (the draft computes the rest itself, the same keys at the same
places another request's draft would write), and a block the scheduler hands out afresh is
not filled until the draft writes all of it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from vlite.core.outputs import SchedulerOutput
from vlite.worker.input_batch import CachedRequestState, prepare_inputs
from vlite.worker.input_buffers import InputBuffers


@dataclass
class _DraftCache:
    """What the draft's cache holds of one request.

    Attributes:
        valid: positions ``[0, valid)`` hold the request's tokens.
        written: the drafts written at positions ``valid, valid + 1, ...``, not yet known to
            be the request's tokens.
        num_tokens_at_cache_start: for models whose keys depend on it (LongRoPE), see
            :class:`~vlite.worker.input_batch.CachedRequestState`.
    """

    valid: int
    written: list[int] = field(default_factory=list)
    num_tokens_at_cache_start: int = 0


@dataclass
class _DraftInput:
    """A request as :func:`~vlite.worker.input_batch.prepare_inputs` reads it: compute
    ``token_ids[num_computed_tokens:]``'s scheduled count over ``block_ids``."""

    request_id: str
    token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int
    num_tokens_at_cache_start: int = 0
    pending_token: None = None


class DraftModel:
    """The draft model of one worker: its model, KV cache and what the cache holds.

    Args:
        runner: a :class:`~vlite.worker.model_runner.ModelRunner` of the draft model (its
            forward, KV cache and decode graphs; its sampler is not used).
        vocab_size: the target's vocabulary (drafts are argmaxes over it).
    """

    def __init__(self, runner, vocab_size: int) -> None:
        self.runner = runner
        self.vocab_size = vocab_size
        self.block_size: int = runner.block_size
        self.buffers = InputBuffers(runner.device)
        self._caches: dict[str, _DraftCache] = {}
        #: ``[num_blocks]``: whether the draft filled the block for the tokens it holds.
        self._filled = np.zeros(0, dtype=bool)

    def initialize_kv_cache(self, num_blocks: int, dtype: torch.dtype) -> None:
        self.runner.initialize_kv_cache(num_blocks, dtype)
        self._filled = np.zeros(num_blocks, dtype=bool)

    def update_states(self, scheduler_output: SchedulerOutput) -> None:
        """Forget finished requests and what the scheduler took back from the others; count
        the filled blocks of prefix hits."""
        for request_id in scheduler_output.finished_request_ids:
            self._caches.pop(request_id, None)
        for new in scheduler_output.new_requests:
            self._start(new.request_id, new.block_ids, new.num_computed_tokens)
        for cached in scheduler_output.cached_requests:
            if cached.is_resumed or cached.request_id not in self._caches:
                self._start(cached.request_id, cached.new_block_ids, cached.num_computed_tokens)
                continue
            if cached.num_kept_blocks is not None:  # positions past them were given back
                self._keep_positions(cached.request_id, cached.num_kept_blocks * self.block_size)
            self._filled[cached.new_block_ids] = False

    def _start(self, request_id: str, block_ids: list[int], num_cached: int) -> None:
        """A request (re)starts over ``block_ids``, whose first ``num_cached`` tokens are
        prefix hits: valid as far as the draft filled those blocks."""
        num_hit_blocks = num_cached // self.block_size
        filled = self._filled[block_ids[:num_hit_blocks]]
        num_filled = num_hit_blocks if filled.all() else int(np.argmin(filled))
        self._filled[block_ids[num_hit_blocks:]] = False
        self._caches[request_id] = _DraftCache(num_filled * self.block_size)

    def _keep_positions(self, request_id: str, num_positions: int) -> None:
        cache = self._caches[request_id]
        del cache.written[max(num_positions - cache.valid, 0) :]
        cache.valid = min(cache.valid, num_positions)

    @torch.inference_mode()
    def propose(
        self,
        states: list[CachedRequestState],
        sampled: set[str],
        num_drafts: dict[str, int],
    ) -> dict[str, list[int]]:
        """Catch up on the step's tokens, then draft.

        Args:
            states: the step's scheduled requests, after the target's step (their tokens
                include those it sampled).
            sampled: the requests that got tokens this step.
            num_drafts: request id -> drafts wanted (``num_lookahead_tokens``).

        Returns:
            request id -> its drafts, for the requests in ``sampled`` that wanted some.
        """
        drafting = [s for s in states if num_drafts.get(s.request_id) and s.request_id in sampled]
        drafting_ids = {s.request_id for s in drafting}
        # Prompts are computed alike; a decoding request that does not draft sits it out.
        drafts = self._catch_up(
            [s for s in states if s.request_id in drafting_ids or _in_prompt(s)], drafting_ids
        )
        for round_index in range(1, max((num_drafts[s.request_id] for s in drafting), default=0)):
            going = [s for s in drafting if num_drafts[s.request_id] > round_index]
            self._draft_one_more(going, drafts)
        for state in drafting:  # each draft but the last was written after its tokens
            self._caches[state.request_id].written = drafts[state.request_id][:-1]
        return drafts

    def _catch_up(
        self, states: list[CachedRequestState], drafting: set[str]
    ) -> dict[str, list[int]]:
        """Compute every scheduled request's known tokens the cache lacks (up to the one
        sampled this step for those ``drafting``); their first drafts."""
        inputs, counts = [], []
        for state in states:
            cache = self._caches[state.request_id]
            start = cache.valid
            self._keep_accepted(cache, state.token_ids)
            if state.request_id in drafting:
                end = len(state.token_ids)
                cache.valid = min(cache.valid, end - 1)  # the last token's logits are needed
            else:  # what the target computed (not its rejected drafts)
                end = min(state.num_computed_tokens, len(state.token_ids) - 1)
            if end > cache.valid:
                inputs.append(self._input(state, cache, state.token_ids))
                counts.append(end - cache.valid)
                self._mark_filled(state.block_ids, min(start, cache.valid), end)
                cache.valid = end
                cache.written = []
        if not inputs:
            return {}
        return {
            request_id: [token]
            for request_id, token in self._forward(inputs, counts).items()
            if request_id in drafting
        }

    def _draft_one_more(
        self, states: list[CachedRequestState], drafts: dict[str, list[int]]
    ) -> None:
        """Compute each request's last draft and append the next."""
        inputs = []
        for state in states:
            cache = self._caches[state.request_id]
            tokens = [*state.token_ids, *drafts[state.request_id]]
            inputs.append(self._input(state, cache, tokens, num_computed=len(tokens) - 1))
        for request_id, token in self._forward(inputs, [1] * len(inputs)).items():
            drafts[request_id].append(token)

    def _input(
        self,
        state: CachedRequestState,
        cache: _DraftCache,
        tokens: list[int],
        num_computed: int | None = None,
    ) -> _DraftInput:
        return _DraftInput(
            state.request_id,
            tokens,
            state.block_ids,
            cache.valid if num_computed is None else num_computed,
            cache.num_tokens_at_cache_start,
        )

    def _forward(self, inputs: list[_DraftInput], counts: list[int]) -> dict[str, int]:
        """Run the draft over ``counts[i]`` tokens of each input; the argmax after each
        input whose tokens reach its end."""
        for item, count in zip(inputs, counts):
            needed = -(-(item.num_computed_tokens + count) // self.block_size)
            if len(item.block_ids) < needed:
                raise RuntimeError(
                    f"request {item.request_id!r}: the draft model writes position "
                    f"{item.num_computed_tokens + count - 1} but the request holds "
                    f"{len(item.block_ids)} blocks (its lookahead slots were not allocated)"
                )
        # A few tokens compute as one-token sequences: a decode step, replayed if recorded.
        graphs = self.runner.decode_graphs
        as_decodes = graphs is not None and graphs.padded_size(sum(counts)) is not None
        batch = prepare_inputs(
            inputs, counts, self.block_size, self.runner.device, self.buffers, None, as_decodes
        )
        for item in inputs:
            self._caches[item.request_id].num_tokens_at_cache_start = item.num_tokens_at_cache_start
        if not batch.sampled_request_ids:
            self.runner.forward(batch)
            return {}
        hidden = self.runner.forward(batch)
        logits = self.runner.model.compute_logits(hidden[batch.logits_indices])
        tokens = logits[:, : self.vocab_size].argmax(dim=-1).tolist()
        return dict(zip(batch.sampled_request_ids, tokens))

    def _mark_filled(self, block_ids: list[int], start: int, end: int) -> None:
        """Positions ``[start, end)`` of the request over ``block_ids`` are being written
        (``[0, start)`` hold its tokens already): the blocks they complete are filled."""
        first, last = start // self.block_size, end // self.block_size
        self._filled[block_ids[first:last]] = True

    @staticmethod
    def _keep_accepted(cache: _DraftCache, token_ids: list[int]) -> None:
        """Count the drafts written after ``valid`` that are now the request's tokens."""
        kept = 0
        for draft in cache.written:
            if cache.valid + kept >= len(token_ids) or token_ids[cache.valid + kept] != draft:
                break
            kept += 1
        cache.valid += kept
        cache.written = []


def _in_prompt(state: CachedRequestState) -> bool:
    """Whether the step computed prompt tokens of the request (``num_computed_tokens`` is
    the count after the step)."""
    return state.num_computed_tokens <= state.num_prompt_tokens
