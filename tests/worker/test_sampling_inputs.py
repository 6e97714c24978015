"""The model runner's sampling inputs: metadata flags and the min-tokens stop-token mask."""

from __future__ import annotations

import torch

from vlite.core.sampling_params import SamplingParams
from vlite.worker.input_batch import CachedRequestState
from vlite.worker.sampling_inputs import build_sampling_metadata, min_tokens_mask

CPU = torch.device("cpu")


def state(params: SamplingParams, num_output: int = 0, stop_ids=()) -> CachedRequestState:
    prompt = [1, 2, 3]
    return CachedRequestState(
        "r", prompt + [4] * num_output, params, [], 0, len(prompt), None, list(stop_ids)
    )


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


def test_min_tokens_mask_covers_rows_short_of_min_tokens_only():
    states = [
        state(SamplingParams(min_tokens=3), num_output=2, stop_ids=[7, 9]),
        state(SamplingParams(min_tokens=3), num_output=3, stop_ids=[7]),
        state(SamplingParams(), stop_ids=[]),
        state(SamplingParams(min_tokens=5), num_output=0, stop_ids=[5, 99]),  # 99: not a token
    ]

    rows, token_ids = min_tokens_mask(states, CPU, vocab_size=10)

    assert list(zip(rows.tolist(), token_ids.tolist())) == [(0, 7), (0, 9), (3, 5)]
    assert min_tokens_mask(states[1:3], CPU, vocab_size=10) is None
