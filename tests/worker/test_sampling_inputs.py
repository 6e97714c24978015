"""The model runner's sampling inputs: metadata flags and per-row values."""

from __future__ import annotations

import torch

from vlite.core.sampling_params import SamplingParams
from vlite.worker.input_batch import CachedRequestState
from vlite.worker.sampling_inputs import build_sampling_metadata

CPU = torch.device("cpu")


def state(params: SamplingParams, num_output: int = 0) -> CachedRequestState:
    prompt = [1, 2, 3]
    return CachedRequestState("r", prompt + [4] * num_output, params, [], 0, len(prompt))


def test_unused_features_build_nothing():
    states = [state(SamplingParams(temperature=0.7)), state(SamplingParams(temperature=0))]

    metadata = build_sampling_metadata(states, CPU, vocab_size=10)

    assert metadata.min_p is None and metadata.penalties is None
    assert not metadata.has_min_p and not metadata.has_penalties


def test_used_features_build_per_row_values():
    states = [
        state(SamplingParams(temperature=0.7, min_p=0.2)),
        state(SamplingParams(repetition_penalty=1.5), num_output=2),
    ]

    metadata = build_sampling_metadata(states, CPU, vocab_size=10)

    assert metadata.min_p.tolist() == [0.20000000298023224, 0.0]
    assert metadata.penalties.repetition_penalty.tolist() == [1.0, 1.5]
    assert metadata.penalties.output_token_ids.tolist() == [[10, 10], [4, 4]]


def test_min_p_on_greedy_rows_only_is_left_out():
    metadata = build_sampling_metadata([state(SamplingParams(temperature=0, min_p=0.5))], CPU, 10)

    assert metadata.min_p is None
