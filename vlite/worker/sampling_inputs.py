"""The per-step sampling inputs of the model runner: SamplingMetadata.

Built once per step from the sampled rows' request states. A feature no row of the batch
uses adds nothing but a flag check: its tensors are not built at all.
"""

from __future__ import annotations

import numpy as np
import torch

from vlite.core.sampler import SamplingMetadata, SamplingPenalties
from vlite.worker.input_batch import CachedRequestState


def build_sampling_metadata(
    states: list[CachedRequestState],
    device: torch.device,
    vocab_size: int,
    has_extras: bool = True,
    row_drafts: list[list[int]] | None = None,
) -> SamplingMetadata:
    """Tensors of the sampled rows' settings, in row order.

    Args:
        states: the request of each sampled row.
        device: where the tensors go.
        vocab_size: width of the logits (the padding id of token histories).
        has_extras: whether any row has ``has_sampling_extras``; ``False`` skips looking
            for min-p and penalties.
        row_drafts: speculative decoding: each row's draft tokens before it (its output so
            far, as the penalties count it, is the request's and these).
    """
    params = [state.sampling_params for state in states]
    temperature = [0.0 if p.is_greedy else float(p.temperature) for p in params]
    top_k = [p.top_k for p in params]
    top_p = [float(p.top_p) for p in params]
    is_all_greedy = all(t == 0.0 for t in temperature)
    min_p = penalties = None
    if has_extras and not is_all_greedy and any(p.min_p > 0 for p in params):
        min_p = _on_device([float(p.min_p) for p in params], torch.float32, device)
    if has_extras and any(p.has_penalties for p in params):
        penalties = build_penalties(states, device, vocab_size, row_drafts)
    return SamplingMetadata(
        temperature=_on_device(temperature, torch.float32, device),
        top_k=_on_device(top_k, torch.int64, device),
        top_p=_on_device(top_p, torch.float32, device),
        generators={
            row: state.generator
            for row, state in enumerate(states)
            if state.generator is not None and not state.sampling_params.is_greedy
        },
        is_all_greedy=is_all_greedy,
        has_top_k=any(k > 0 for k in top_k),
        has_top_p=any(p < 1.0 for p in top_p),
        min_p=min_p,
        penalties=penalties,
    )


def build_penalties(
    states: list[CachedRequestState],
    device: torch.device,
    vocab_size: int,
    row_drafts: list[list[int]] | None = None,
) -> SamplingPenalties:
    """The rows' penalties and padded token histories (empty for rows without penalties;
    ``row_drafts``: see :func:`build_sampling_metadata`)."""
    params = [state.sampling_params for state in states]
    prompts, outputs = [], []
    for row, (state, p) in enumerate(zip(states, params)):
        if p.has_penalties:
            prompts.append(state.token_ids[: state.num_prompt_tokens])
            drafted = row_drafts[row] if row_drafts else []
            outputs.append(state.token_ids[state.num_prompt_tokens :] + drafted)
        else:
            prompts.append([])
            outputs.append([])

    def values(name: str) -> torch.Tensor:
        return _on_device([float(getattr(p, name)) for p in params], torch.float32, device)

    return SamplingPenalties(
        presence_penalty=values("presence_penalty"),
        frequency_penalty=values("frequency_penalty"),
        repetition_penalty=values("repetition_penalty"),
        prompt_token_ids=_padded_tensor(prompts, vocab_size, device),
        output_token_ids=_padded_tensor(outputs, vocab_size, device),
    )


def _on_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``values`` as a 1-D tensor on ``device``, copied without waiting for the device's
    queue (``torch.tensor(..., device="cuda")`` waits for every kernel launched so far)."""
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


def _padded_tensor(rows: list[list[int]], pad_id: int, device: torch.device) -> torch.Tensor:
    """``[len(rows), longest]`` int64, each row padded with ``pad_id``."""
    longest = max((len(row) for row in rows), default=0)
    array = np.full((len(rows), longest), pad_id, dtype=np.int64)
    for index, row in enumerate(rows):
        array[index, : len(row)] = row
    return torch.from_numpy(array).to(device=device, non_blocking=True)
