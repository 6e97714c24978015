"""ModelRunner: per-request worker state, input preparation, forward pass and sampling."""

from __future__ import annotations

import torch

from vlite.core.outputs import ModelRunnerOutput, SchedulerOutput
from vlite.core.sampler import Sampler, SamplingMetadata
from vlite.worker.input_batch import CachedRequestState, ModelInputs, prepare_inputs


class ModelRunner:
    """Runs one model over the batches the scheduler describes.

    Args:
        model: a :class:`~vlite.core.model.CausalLM`.
        sampler: the sampler plugin instance.
        block_size: token slots per KV-cache block.
        device: where inputs are built.
    """

    def __init__(self, model, sampler: Sampler, block_size: int, device: torch.device) -> None:
        self.model = model
        self.sampler = sampler
        self.block_size = block_size
        self.device = device
        self.kv_caches: list[torch.Tensor] = []
        self.requests: dict[str, CachedRequestState] = {}
        self._pending: tuple[ModelInputs, torch.Tensor] | None = None

    def initialize_kv_cache(self, num_blocks: int, dtype: torch.dtype) -> None:
        shape = self.model.attention.kv_cache_shape(num_blocks)
        self.kv_caches = [
            torch.zeros(shape, dtype=dtype, device=self.device)
            for _ in range(self.model.num_layers)
        ]

    # ---- state updates -------------------------------------------------------------

    def update_states(self, scheduler_output: SchedulerOutput) -> None:
        """Apply the scheduler's diff to the per-request state."""
        for request_id in scheduler_output.finished_request_ids:
            self.requests.pop(request_id, None)
        for new in scheduler_output.new_requests:
            params = new.sampling_params
            self.requests[new.request_id] = CachedRequestState(
                request_id=new.request_id,
                token_ids=list(new.token_ids),
                sampling_params=params,
                block_ids=list(new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
                generator=_make_generator(params.seed, self.device),
            )
        for cached in scheduler_output.cached_requests:
            state = self.requests[cached.request_id]
            if cached.is_resumed:
                state.block_ids = list(cached.new_block_ids)
            else:
                state.block_ids += cached.new_block_ids
            state.num_computed_tokens = cached.num_computed_tokens

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
        inputs = prepare_inputs(states, list(scheduled.values()), self.block_size, self.device)
        hidden = self.model.forward(
            inputs.input_ids, inputs.positions, self.kv_caches, inputs.attn_metadata
        )
        logits = self.model.compute_logits(hidden[inputs.logits_indices])
        for state, num_tokens in zip(states, scheduled.values()):
            state.num_computed_tokens += num_tokens
        self._pending = (inputs, logits)

    @torch.inference_mode()
    def sample_tokens(self) -> ModelRunnerOutput:
        """Sample one token for every sequence that reached its end in the last forward."""
        if self._pending is None:
            return ModelRunnerOutput(sampled_token_ids={})
        inputs, logits = self._pending
        self._pending = None
        request_ids = inputs.sampled_request_ids
        if not request_ids:
            return ModelRunnerOutput(sampled_token_ids={})
        states = [self.requests[request_id] for request_id in request_ids]
        metadata = build_sampling_metadata(states, self.device)
        token_ids = self.sampler.sample(logits, metadata).tolist()
        for state, token_id in zip(states, token_ids):
            state.token_ids.append(token_id)
        return ModelRunnerOutput(
            sampled_token_ids={rid: [tid] for rid, tid in zip(request_ids, token_ids)}
        )


def _make_generator(seed: int | None, device: torch.device) -> torch.Generator | None:
    if seed is None:
        return None
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


def build_sampling_metadata(
    states: list[CachedRequestState], device: torch.device
) -> SamplingMetadata:
    """Tensors of the sampled rows' settings, in row order."""
    params = [state.sampling_params for state in states]
    temperature = [0.0 if p.is_greedy else float(p.temperature) for p in params]
    top_k = [p.top_k for p in params]
    top_p = [float(p.top_p) for p in params]
    return SamplingMetadata(
        temperature=torch.tensor(temperature, dtype=torch.float32, device=device),
        top_k=torch.tensor(top_k, dtype=torch.int64, device=device),
        top_p=torch.tensor(top_p, dtype=torch.float32, device=device),
        generators={
            row: state.generator
            for row, state in enumerate(states)
            if state.generator is not None and not state.sampling_params.is_greedy
        },
        is_all_greedy=all(t == 0.0 for t in temperature),
        has_top_k=any(k > 0 for k in top_k),
        has_top_p=any(p < 1.0 for p in top_p),
    )
