"""ModelRunner: per-request worker state, input preparation, forward pass and sampling."""

from __future__ import annotations

from collections import deque
from concurrent.futures import Future

import torch

from vlite.core.logits_processor import AddedRequest
from vlite.core.outputs import GrammarBitmask, ModelRunnerOutput, PromptLogprobs, SchedulerOutput
from vlite.core.sampler import Sampler
from vlite.distributed.pipeline import SINGLE_STAGE, PipelineParallelGroup
from vlite.worker.cpu_memory import lazily_zeroed
from vlite.worker.cuda_graphs import (
    CaptureReport,
    DecodeGraphs,
    DecodeInputBuffers,
    GraphCapturer,
)
from vlite.worker.draft_model import DraftModel
from vlite.worker.draft_verification import drafts_before_rows, verify_drafts
from vlite.worker.grammar_mask import apply_grammar_bitmask
from vlite.worker.input_batch import CachedRequestState, ModelInputs, prepare_inputs
from vlite.worker.input_buffers import InputBuffers
from vlite.worker.logits_processors import LogitsProcessorPipeline
from vlite.worker.logprobs import LogprobsRequest
from vlite.worker.prompt_logprobs import prompt_logprobs
from vlite.worker.sampled_tokens import SampledTokens, resolve_all
from vlite.worker.sampling_inputs import build_sampling_metadata

__all__ = ["ModelRunner", "build_sampling_metadata"]


class ModelRunner:
    """Runs one model over the batches the scheduler describes.

    Args:
        model: a :class:`~vlite.core.model.CausalLM`.
        sampler: the sampler plugin instance.
        block_size: token slots per KV-cache block.
        device: where inputs are built.
        logits_processors: run on the sampled rows' logits before the sampler (default:
            none).
        draft_model: speculative decoding's draft model, run after each step's sampling
            (:mod:`vlite.worker.draft_model`; default: none).
    """

    def __init__(
        self,
        model,
        sampler: Sampler,
        block_size: int,
        device: torch.device,
        logits_processors: LogitsProcessorPipeline | None = None,
        draft_model: DraftModel | None = None,
    ) -> None:
        self.model = model
        self.draft_model = draft_model
        self.sampler = sampler
        self.logits_processors = logits_processors or LogitsProcessorPipeline([])
        self.block_size = block_size
        self.device = device
        self.kv_caches: list[torch.Tensor] = []
        self.requests: dict[str, CachedRequestState] = {}
        #: The persistent tensors each step's inputs are written into.
        self.input_buffers = InputBuffers(device)
        #: Sampled steps whose tokens are not on the host yet, oldest first.
        self._unresolved: deque[SampledTokens] = deque()
        self._pending: (
            tuple[ModelInputs, torch.Tensor, GrammarBitmask | None, dict[str, list[int]]] | None
        ) = None
        #: This worker's pipeline stage (the only one without pipeline parallelism).
        self.pipeline: PipelineParallelGroup = getattr(model, "pp_group", SINGLE_STAGE)
        #: Captured decode forwards (:meth:`capture_decode_graphs`; ``None``: all eager).
        self.decode_graphs: DecodeGraphs | None = None
        #: The last step's scheduled requests and the drafts asked of each (a draft model's).
        self._drafting: tuple[list[CachedRequestState], dict[str, int]] = ([], {})
        #: The last step's prompt logprobs (:mod:`vlite.worker.prompt_logprobs`).
        self._prompt_logprobs: dict[str, PromptLogprobs] = {}

    def initialize_kv_cache(self, num_blocks: int, dtype: torch.dtype) -> None:
        shape = self.model.attention.kv_cache_shape(num_blocks)
        if self.device.type == "cpu":  # resident as its blocks are first written
            self.kv_caches = [lazily_zeroed(shape, dtype) for _ in range(self.model.num_layers)]
        else:
            self.kv_caches = [
                torch.zeros(shape, dtype=dtype, device=self.device)
                for _ in range(self.model.num_layers)
            ]
        if self.draft_model is not None:
            self.draft_model.initialize_kv_cache(num_blocks, dtype)

    @torch.inference_mode()
    def capture_decode_graphs(
        self, sizes: tuple[int, ...], max_seq_len: int, capturer: GraphCapturer
    ) -> CaptureReport:
        """Capture the decode forward for every batch size of ``sizes`` over the allocated
        KV cache; later decode steps of at most ``max(sizes)`` sequences replay (padded to
        the next size captured).

        Args:
            sizes: the decode batch sizes captured (:func:`capture_sizes` on CUDA).
            max_seq_len: the longest context a replayed step may have.
            capturer: how graphs are made (:class:`~vlite.worker.cuda_graphs.GraphCapturer`).

        Raises:
            NotCapturable: the capturer cannot record this model's forward at any of
                ``sizes`` (:class:`~vlite.worker.cpu_graphs.NativeCallCapturer`); nothing
                is replayed. Sizes it refuses among others run eagerly (the report's
                ``eager_sizes``).
        """
        max_blocks = -(-max_seq_len // self.block_size)
        buffers = DecodeInputBuffers(max(sizes), max_blocks, self.device)

        def forward(input_ids, positions, metadata):
            return self.model.forward(input_ids, positions, self.kv_caches, metadata)

        graphs = DecodeGraphs(forward, buffers, max_seq_len, capturer)
        report = graphs.capture(sizes)
        self.decode_graphs = graphs
        return report

    # ---- state updates -------------------------------------------------------------

    def update_states(self, scheduler_output: SchedulerOutput) -> None:
        """Apply the scheduler's diff to the per-request state."""
        if self.draft_model is not None:
            self.draft_model.update_states(scheduler_output)
        for request_id in scheduler_output.finished_request_ids:
            self.requests.pop(request_id, None)
            self.logits_processors.remove_request(request_id)
        for new in scheduler_output.new_requests:
            state = self.requests[new.request_id] = CachedRequestState.from_new(new, self.device)
            self.logits_processors.add_request(
                AddedRequest(
                    new.request_id,
                    state.sampling_params,
                    state.token_ids,  # the live list: processors see sampled tokens
                    state.num_prompt_tokens,
                    new.eos_token_id,
                )
            )
        for cached in scheduler_output.cached_requests:
            state = self.requests[cached.request_id]
            if cached.is_resumed:
                state.block_ids = list(cached.new_block_ids)
            else:
                if cached.num_kept_blocks is not None:  # blocks of rejected drafts went back
                    del state.block_ids[cached.num_kept_blocks :]
                state.block_ids += cached.new_block_ids
            state.num_computed_tokens = cached.num_computed_tokens
            _learn_tokens(state, cached.num_computed_tokens, cached.new_token_ids)

    # ---- the step ------------------------------------------------------------------

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> None:
        """Forward pass over the scheduled tokens; keeps the logits for :meth:`sample_tokens`."""
        self.update_states(scheduler_output)
        if scheduler_output.is_empty:
            self._pending = None
            return
        scheduled = scheduler_output.num_scheduled_tokens
        states = [self.requests[request_id] for request_id in scheduled]
        num_scheduled = list(scheduled.values())
        drafts = scheduler_output.spec_token_ids
        inputs = prepare_inputs(
            states, num_scheduled, self.block_size, self.device, self.input_buffers, drafts
        )
        hidden = self.forward(inputs)
        # Prompt logprobs need each chunk's start (a rare request: one check per step).
        takes_prompt_logprobs = any(s.sampling_params.prompt_logprobs is not None for s in states)
        num_computed = [s.num_computed_tokens for s in states] if takes_prompt_logprobs else []
        for state, num_tokens in zip(states, num_scheduled):
            state.num_computed_tokens += num_tokens
        if self.draft_model is not None:
            self._drafting = (states, scheduler_output.num_lookahead_tokens)
        if not self.pipeline.is_last:  # handed on: the last stage samples
            self.pipeline.send(hidden)
            self._pending = None
            return
        logits = self.model.compute_logits(hidden[inputs.logits_indices])
        self._pending = (inputs, logits, scheduler_output.grammar_bitmask, drafts)
        if takes_prompt_logprobs:
            self._prompt_logprobs = prompt_logprobs(
                self.model, hidden, states, num_scheduled, num_computed
            )

    def forward(self, inputs: ModelInputs) -> torch.Tensor | list[torch.Tensor]:
        """The model over the step's tokens: hidden states ``[T, hidden]`` (on a stage
        before the last, the tensors for the next stage)."""
        args = (inputs.input_ids, inputs.positions, self.kv_caches, inputs.attn_metadata)
        if self.pipeline.num_stages == 1:
            if self.decode_graphs is not None:
                hidden = self.decode_graphs.replay(
                    inputs.input_ids, inputs.positions, inputs.attn_metadata
                )
                if hidden is not None:
                    return hidden
            return self.model.forward(*args)
        intermediate = None
        if not self.pipeline.is_first:
            shape = (inputs.input_ids.shape[0], self.model.config.hidden_size)
            count = self.model.num_intermediate_tensors
            dtype = next(self.model.parameters()).dtype  # the stages' activations' dtype
            intermediate = self.pipeline.recv(count, shape, dtype, self.device)
        return self.model.forward(*args, intermediate_tensors=intermediate)

    def sample_tokens(self) -> ModelRunnerOutput:
        """Sample one token for every sequence that reached its end in the last forward."""
        return self.sample_tokens_deferred().result()

    def sample_tokens_deferred(self) -> Future[ModelRunnerOutput]:
        """:meth:`sample_tokens`, its tokens left on the device until ``result()`` (see
        :mod:`vlite.worker.sampled_tokens`); the next step may run meanwhile. With a draft
        model, the draft then runs over the step (:mod:`vlite.worker.draft_model`) and its
        drafts come with the tokens."""
        sampled = self._sample_tokens()
        taken, self._prompt_logprobs = self._prompt_logprobs, {}
        if self.draft_model is None and not taken:
            return sampled
        output = sampled.result()
        output.prompt_logprobs = taken
        if self.draft_model is not None:
            states, num_drafts = self._drafting
            self._drafting = ([], {})
            output.draft_token_ids = self.draft_model.propose(
                states, set(output.sampled_token_ids), num_drafts
            )
        done: Future[ModelRunnerOutput] = Future()
        done.set_result(output)
        return done

    @torch.inference_mode()
    def _sample_tokens(self) -> Future[ModelRunnerOutput]:
        if self._pending is None:
            return self._nothing_sampled()
        inputs, logits, grammar_bitmask, drafts = self._pending
        self._pending = None
        request_ids = inputs.sampled_request_ids
        if not request_ids:
            return self._nothing_sampled()
        states = [self.requests[request_id] for request_id in request_ids]
        if grammar_bitmask is not None or any(state.reads_own_tokens for state in states):
            resolve_all(self._unresolved)  # what samples them reads every token so far
        vocab_size = logits.shape[-1]
        # One check keeps a batch that uses no min-p, penalty or logprobs cheap.
        has_extras = any(state.has_sampling_extras for state in states)
        row_drafts = drafts_before_rows(request_ids, drafts) if drafts else None
        metadata = build_sampling_metadata(states, self.device, vocab_size, has_extras, row_drafts)
        logprobs_request = None
        if has_extras:
            # Raw logprobs: before the logits processors and whatever the sampler does.
            logprobs_request = LogprobsRequest.capture(
                logits, [state.sampling_params.logprobs for state in states]
            )
        logits = self.logits_processors.apply(logits, request_ids, row_drafts)
        if grammar_bitmask is not None:  # last: the grammar has the final word
            apply_grammar_bitmask(logits, request_ids, grammar_bitmask)
        sampled = self.sampler.sample(logits, metadata)
        if drafts:
            resolve_all(self._unresolved)  # the requests' tokens are appended in order
            return verify_drafts(request_ids, states, sampled, drafts, logprobs_request)
        return SampledTokens(request_ids, states, sampled, self._unresolved, logprobs_request)

    def _nothing_sampled(self) -> Future[ModelRunnerOutput]:
        """The output of a step that samples no row; the logits processors still hear of
        the requests that finished, so that they forget them."""
        if self.logits_processors.has_pending_changes:
            self.logits_processors.update_state([])
        done: Future[ModelRunnerOutput] = Future()
        done.set_result(ModelRunnerOutput(sampled_token_ids={}))
        return done


def _learn_tokens(state: CachedRequestState, start: int, token_ids: list[int]) -> None:
    """Write ``token_ids`` at positions ``start...`` of the request's tokens (a worker that
    did not sample them, an earlier pipeline stage, learns them; others rewrite the same)."""
    if token_ids:
        state.token_ids[start : start + len(token_ids)] = token_ids
